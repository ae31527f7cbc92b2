"""Tolerances derived from the quantities a comparison involves, not from one machine's observation.

Two numerically different paths (micro-batching, sharding, a correction pass) give gradients that
differ by float32 rounding; AdamW turns that into weight differences that can be far larger where
a gradient entry is near 0 (its step is lr g / (|g| + eps)). `adam_weight_bounds` bounds them entry
by entry from the reference gradients and the measured gradient gap.
"""

from __future__ import annotations

import torch


def max_gap(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest |got - ref| over every entry of every tensor."""
    return max(float((got[k].double() - v.double()).abs().max()) for k, v in ref.items())


def adam_weight_bounds(grads_U: list[dict], gaps_U: list[float], optim) -> list[dict[str, torch.Tensor]]:
    """Per-entry bounds on how far AdamW's weights after each update can move when every gradient
    entry of update k moves by at most `gaps_U[k]`, from the reference gradients `grads_U`
    (the gradients the optimizer applied, after the clip) and the recipe's `[optim]`.

    Adam's step is lr m / (sqrt(v) + eps) with bias-corrected moments, each a weighted mean (weights
    summing to 1) of the gradients so far or of their squares: both m and sqrt(v) move by at most
    delta = the largest gap so far, so the step moves by at most lr delta (1 + |m| / sqrt(v)) /
    (sqrt(v) - delta + eps). Over the first few updates Adam's weights are near uniform and
    |m| / sqrt(v) <= 1.01 (Cauchy-Schwarz), so 3 bounds the factor. Decoupled weight decay carries
    the previous difference on (x (1 + lr wd)); float32 rounding adds 4 ulps of the weight per
    update (`within`).
    """
    (_, b2), eps, lr, wd = optim.betas, optim.eps, optim.lr, optim.weight_decay
    bounds: list[dict[str, torch.Tensor]] = []
    v: dict[str, torch.Tensor] = {}
    for u, grads in enumerate(grads_U):
        delta = max(gaps_U[: u + 1])
        v = {k: b2 * v.get(k, 0.0) + (1 - b2) * g.double().square() for k, g in grads.items()}
        moved = {}
        for k in grads:
            root_v = (v[k] / (1 - b2 ** (u + 1))).sqrt()
            step = 3 * lr * delta / ((root_v - delta).clamp(min=0) + eps)
            moved[k] = step + (bounds[-1][k] * (1 + lr * wd) if bounds else 0.0)
        bounds.append(moved)
    return bounds


def within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, updates: int) -> bool:
    """|got - ref| <= bound + 4 ulps of the weight per update, at every entry."""
    ulps = 4 * updates * torch.finfo(torch.float32).eps * ref.abs().double()
    return bool(((got.double() - ref.double()).abs() <= bound + ulps).all())


def forward_atol(reference: torch.Tensor, num_layers: int) -> float:
    """How far two float32 implementations of the same network may differ at its output: each of
    a layer's ~8 matmuls and reductions rounds its sums to a few ulps of the activations' scale
    (taken as the output's largest |value|), over `num_layers` layers and the head; 8x margin."""
    return 8 * 8 * (num_layers + 1) * torch.finfo(torch.float32).eps * float(reference.abs().max())
