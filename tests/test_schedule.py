"""The schedule against a literal walk through a run: step after step, pass after pass, mini-batch
after mini-batch, one update each."""

from __future__ import annotations

import pytest
import torch

from m2po_cli.schedule import Schedule


def literal_run(per_step: int, per_update: int, epochs: int, steps: int):
    """{group index: the updates that train it, in order}, and the groups taken before each step."""
    trained: dict[int, list[int]] = {}
    taken_before, update = [], 0
    for step in range(steps):
        taken_before.append((update, step * per_step))
        for _ in range(epochs):
            for first in range(step * per_step, (step + 1) * per_step, per_update):
                for group in range(first, first + per_update):
                    trained.setdefault(group, []).append(update)
                update += 1
    return trained, taken_before


@pytest.mark.parametrize("per_step, per_update, epochs", [(4, 4, 1), (8, 2, 1), (6, 2, 3), (4, 1, 2)])
def test_updates_and_step_starts_match_a_literal_run(per_step, per_update, epochs):
    schedule = Schedule(per_step, per_update, n=3, epochs=epochs)
    trained, taken_before = literal_run(per_step, per_update, epochs, steps=5)
    assert schedule.updates_per_step == epochs * per_step // per_update
    for group, updates in trained.items():
        assert [schedule.update_of(group, e) for e in range(epochs)] == updates
        assert (schedule.first_update(group), schedule.last_update(group)) == (updates[0], updates[-1])
    for version, groups in taken_before:
        assert schedule.step_start(version) == groups


def test_a_steps_rows_go_to_their_mini_batch_once_per_pass():
    schedule = Schedule(4, 2, n=3, epochs=2)
    row_B = torch.tensor([0, 1, 5, 6, 7, 11])  # this rank's rows: prompts 0, 1 (update 0) and 2, 3
    assert schedule.mini_batch_of(row_B).tolist() == [0, 0, 0, 1, 1, 1]
    assert [u.tolist() for u in schedule.updates(row_B)] == [[0, 1, 2], [3, 4, 5]] * 2


def test_a_mini_batch_that_does_not_divide_the_step_is_refused():
    with pytest.raises(ValueError, match="multiple of prompts_per_update"):
        Schedule(6, 4, n=2)
