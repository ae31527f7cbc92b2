"""The optimizer's state allocated before the first update, exactly as that update would allocate it.

torch's optimizers create their state (AdamW: two moments of every parameter's size, in float32)
lazily, in the first `step()`. Colocated, that first step comes after the staleness FIFO's warm-up,
1-2 hours at the 8B recipe, and its state (2 x 4 bytes x 8.2 B parameters / 8 ranks = 8.2 GB a rank)
must then fit beside the engine's next wake. `allocate_state` takes it at the start instead, so a
run that cannot hold it fails in its first minutes.
"""

from __future__ import annotations

import torch


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter that has none with one step of zero gradients at learning
    rate 0, then set its step counts back to 0: the moments are zeros, the counts 0 and the parameters
    unchanged, bit for bit, which is what the first real step starts from (tests/learner/test_policy.py
    checks the updates that follow against an optimizer left lazy)."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"] if not optimizer.state.get(p)]
    if not params:  # resumed: loaded with the checkpoint
        return
    fresh = {id(p) for p in params}
    rates = [g["lr"] for g in groups]
    held = {p: p.grad for g in groups for p in g["params"]}
    for g in groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p) if id(p) in fresh else None  # a parameter with state is skipped
    try:
        optimizer.step()
    finally:
        for g, lr in zip(groups, rates, strict=True):
            g["lr"] = lr
        for p, grad in held.items():
            p.grad = grad
    for p in params:
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0
