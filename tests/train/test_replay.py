"""The replay buffer's draws and the rows an update trains, against literal rules, on made-up batches."""

from __future__ import annotations

import pytest
import torch

from m2po_cli.train.reuse import Entry, ReplayBuffer, age_bucket, bucket_label
from tests.conftest import recipe_for
from tests.train.test_packed import random_pack

P, N = 4, 3  # prompts a step, samples a prompt


def buffer_with(
    tmp_path, versions: list[int], weights: list[list[float]] | None = None, **reuse
) -> ReplayBuffer:
    """A buffer holding one made-up batch per entry of `versions` (its groups at that version),
    with the groups' mean |advantage| `weights` (default 1)."""
    table = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in {"mode": "replay", **reuse}.items())
    recipe = recipe_for(tmp_path, f"rollout.prompts_per_step={P}", f"rollout.n={N}", f"reuse={{{table}}}")
    buffer = ReplayBuffer(recipe)
    for step, version in enumerate(versions):
        rows, *_ = random_pack(step, num_prompts=P, n=N)
        rows.version_B[:] = version
        weight_G = torch.tensor(weights[step] if weights else [1.0] * P, dtype=torch.float64)
        buffer.entries.append(Entry(step, rows, torch.full((P,), version), weight_G))
    return buffer


def test_a_draw_is_a_function_of_the_seed_step_and_update(tmp_path):
    buffer = buffer_with(tmp_path, [0, 1, 2], buffer=3, replay=1.0, max_age=100)
    first = buffer.draw(5, 0, 10)
    assert len(first) == P and len(set(first)) == P, "as many groups as the update's fresh ones, none twice"
    assert buffer.draw(5, 0, 10) == first
    assert buffer_with(tmp_path, [0, 1, 2], buffer=3, replay=1.0, max_age=100).draw(5, 0, 10) == first
    others = {tuple(buffer.draw(step, u, 10)) for step in range(5) for u in range(3)}
    assert len(others) > 10, "another step or update draws other groups"


def test_no_group_older_than_max_age_is_drawn(tmp_path):
    buffer = buffer_with(tmp_path, [0, 4, 8], buffer=3, replay=10.0, max_age=5)
    # At version 9 the batch of version 0 is 9 updates old, those of 4 and 8 are 5 and 1.
    drawn = buffer.draw(3, 0, 9)
    assert sorted(drawn) == [(e, g) for e in (1, 2) for g in range(P)], "all within the bound, no more"
    assert buffer.draw(3, 0, 14) == [], "nothing within 5 updates of version 14"


def test_freshest_takes_the_newest_versions(tmp_path):
    buffer = buffer_with(tmp_path, [3, 7, 5], buffer=3, replay=1.5, max_age=100, rule="freshest")
    assert buffer.draw(0, 0, 10) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]


def test_advantage_never_draws_a_group_without_gradient_and_favours_large_ones(tmp_path):
    weights = [[0.0, 1.0, 3.0, 0.0]]
    buffer = buffer_with(tmp_path, [0], weights, buffer=1, replay=0.25, max_age=10**6, rule="advantage")
    drawn = [buffer.draw(step, 0, 1)[0][1] for step in range(2000)]
    assert set(drawn) == {1, 2}
    assert 0.7 < drawn.count(2) / len(drawn) < 0.8  # 3 / (1 + 3)


def test_a_plan_trains_fresh_rows_then_whole_replayed_groups_numbered_after_them(tmp_path):
    buffer = buffer_with(tmp_path, [0, 1], buffer=2, replay=1.0, max_age=100)
    fresh, *_ = random_pack(99, num_prompts=P, n=N)
    fresh.version_B[:] = 2
    plan = buffer.plan(fresh, 7, 2)
    batch = plan.batch
    assert torch.equal(batch.take(torch.arange(fresh.num_rows)).tokens_N, fresh.tokens_N)
    assert plan.split_B[: fresh.num_rows].eq(0).all() and plan.split_B[fresh.num_rows :].gt(0).all()
    drawn = buffer.draw(7, 0, 2)
    for slot, (e, g) in enumerate(drawn):
        rows = buffer.entries[e].rows
        original = rows.take(((rows.row_B // N) == g).nonzero().squeeze(1))
        mine = ((batch.row_B // N) == P + slot).nonzero().squeeze(1)
        assert torch.equal(batch.take(mine).tokens_N, original.tokens_N), "the group, whole and in order"
        assert torch.equal(batch.take(mine).behaviour_R, original.behaviour_R)
        assert torch.equal(batch.row_B[mine] % N, original.row_B % N)
        assert plan.split_B[mine].eq(int(age_bucket(torch.tensor([2 - e])))).all()
    assert plan.updates[0].tolist() == list(range(batch.num_rows))


def test_age_classes():
    ages = torch.tensor([1, 2, 3, 4, 7, 8, 127, 128, 5000])
    assert age_bucket(ages).tolist() == [1, 2, 2, 3, 3, 4, 7, 8, 8]
    assert [bucket_label(k) for k in (1, 2, 3, 8)] == ["1", "2-3", "4-7", "128+"]


@pytest.mark.parametrize("mode", ["epochs", "off"])
def test_without_replay_an_update_trains_its_mini_batch_once_per_pass(tmp_path, mode):
    from m2po_cli.train.reuse import Passes, build_reuse

    sets = ["rollout.prompts_per_step=4", "rollout.n=3", "train.mini_batch_prompts=2"]
    recipe = recipe_for(tmp_path, *sets, f'reuse={{mode="{mode}", epochs=3}}', "staleness.s=0")
    fresh, *_ = random_pack(1, num_prompts=4, n=3)
    reuse = build_reuse(recipe)
    assert isinstance(reuse, Passes)
    updates = reuse.plan(fresh, 5, 10).updates
    passes = 3 if mode == "epochs" else 1
    assert recipe.updates_per_step == 2 * passes
    assert [u.tolist() for u in updates] == [list(range(6)), list(range(6, 12))] * passes
