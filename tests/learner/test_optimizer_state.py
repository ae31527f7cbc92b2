"""The optimizer's state allocated before the first update changes nothing the updates do."""

from __future__ import annotations

import torch

from m2po_cli.learner.optimizer_state import allocate_state
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from tests.conftest import recipe_for


def updated(learner: Learner, steps: int = 3) -> list[torch.Tensor]:
    """The learner's parameters after `steps` updates with the same random gradients every time."""
    params = list(learner.model.parameters())
    for step in range(steps):
        torch.manual_seed(step)
        for p in params:
            p.grad = torch.randn_like(p)
        learner.optimizer.step()
        learner.scheduler.step()
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.clone() for p in params]


def test_state_allocated_up_front_gives_the_updates_of_the_lazy_one_bit_for_bit(tmp_path):
    recipe = recipe_for(tmp_path, "optim.weight_decay=0.1")
    lazy = Learner(resolve_model(recipe.model.path), recipe)
    early = Learner(resolve_model(recipe.model.path), recipe)
    before = [p.full_tensor().clone() for p in early.model.parameters()]
    allocate_state(early.optimizer)
    state = early.optimizer.state
    assert all(float(state[p]["step"]) == 0 and not state[p]["exp_avg_sq"].to_local().any() for p in state)
    assert len(state) == len(before), "a parameter was left without state"
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, early.model.parameters(), strict=True))
    for a, b in zip(updated(lazy), updated(early), strict=True):
        assert torch.equal(a, b)
