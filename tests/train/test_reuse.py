"""Rollout reuse on the real stack: replayed rows keep what sampled them, the age bound holds, the
buffer survives a kill, and epochs train each batch as many times."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.schedule import Schedule
from m2po_cli.train.loop import train
from m2po_cli.train.reuse import ReplayBuffer, plan_passes
from m2po_cli.train.updates import train_on
from tests.conftest import no_record, recipe_for
from tests.rollout.test_weight_sync import sampled_batch
from tests.train.test_determinism import env, killed_when, train_command

pytestmark = pytest.mark.slow

# On-policy, one update a step: the batch trained at step k was sampled at version k. Every update
# replays as many groups as it trains fresh (32 of the 64 that the age bound leaves), so a replayed
# group is 1 or 2 updates old, never 3 (the buffer's oldest batch).
REPLAY = [
    "staleness.s=0",
    'reuse={mode="replay", buffer=3, replay=1.0, max_age=2}',
    "inspect.every=4",
]
ENGINE_LEARNER_GAP = 1e-4  # |engine - learner| logprob of one token under the same weights (float32)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_replayed_rows_carry_their_behaviour_logprobs_and_versions(tmp_path):
    """The rows an update replays are the buffer's rows as sampled: the engine's logprobs and the
    version that sampled them, which the learner's own logprobs under that version reproduce, and
    under the current one do not."""
    recipe = recipe_for(
        tmp_path, "optim.lr=0.02", "rollout.prompts_per_step=4", 'reuse={mode="replay", replay=1.0}'
    )
    model_dir = resolve_model(recipe.model.path)
    learner = Learner(model_dir, recipe)
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", 64)
    try:
        buffer, loss_fn, recorder = (
            ReplayBuffer(recipe),
            build_loss(recipe.loss),
            no_record(tmp_path, learner),
        )
        first = sampled_batch(engine, engine.tokenizer, recipe, learner.version)
        rows = first.to_batch(torch.arange(first.num_rows))
        at_version_0 = learner.score(rows)[0][rows.mask_BL.bool()]  # the reference: rescored at version 0
        assert buffer.plan(first, 0, 0).split_B.sum() == 0, "an empty buffer replays nothing"
        train_on(plan_passes(first, Schedule.of(recipe)), learner, loss_fn, None, recipe, recorder, 0)
        buffer.push(first, 0)
        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)
        second = sampled_batch(engine, engine.tokenizer, recipe, learner.version)
        train_on(
            plan_passes(second, Schedule.of(recipe)), learner, loss_fn, None, recipe, recorder, 1
        )  # the policy moves on

        plan = buffer.plan(second, 2, learner.version)
        replayed = (plan.split_B > 0).nonzero().squeeze(1)
        assert replayed.numel() == first.num_rows, "one update replays as many groups as it trains fresh"
        assert plan.updates[0].tolist() == list(range(plan.batch.num_rows))
        assert int(plan.batch.row_B[replayed].min()) >= second.num_rows, "replayed rows are numbered after"
        tokens_of = {tuple(first.take(torch.tensor([i])).tokens_N.tolist()): i for i in range(first.num_rows)}
        offsets = first.response_offsets()
        for b in replayed.tolist():
            i = tokens_of[tuple(plan.batch.take(torch.tensor([b])).tokens_N.tolist())]
            mine, theirs = plan.batch.response_index(torch.tensor([b])), slice(offsets[i], offsets[i + 1])
            assert torch.equal(plan.batch.behaviour_R[mine], first.behaviour_R[theirs])
            assert (plan.batch.version_R[mine] == 0).all() and int(plan.batch.version_B[b]) == 0
            gap = (plan.batch.behaviour_R[mine] - at_version_0[theirs]).abs().max()
            assert gap < ENGINE_LEARNER_GAP, f"row {i}: rescored at its version, off by {gap:.2e}"
        replayed_rows = plan.batch.to_batch(replayed)
        now = learner.score(replayed_rows)[0][replayed_rows.mask_BL.bool()]
        moved = (plan.batch.behaviour_R[plan.batch.response_index(replayed)] - now).abs().max()
        assert moved > 1e-2, "the policy did not move: the check above could not tell versions apart"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    subprocess.run(
        train_command(out, "whole", *REPLAY), check=True, capture_output=True, env=env(), timeout=900
    )
    return out


def test_replayed_tokens_are_never_older_than_the_bound(uninterrupted):
    rows = metrics(uninterrupted / "whole")
    assert "reuse/replayed_token_frac" not in rows[0] or rows[0]["reuse/replayed_token_frac"] == 0
    for r in rows[1:]:
        assert 0.3 < r["reuse/replayed_token_frac"] < 0.7, r["step"]  # 32 fresh, 32 replayed groups
        assert r["reuse/age_max"] <= 2
        assert (r["staleness/min"], r["staleness/max"]) == (0, 0), "fresh rows stay on-policy"
    assert rows[1]["reuse/age_max"] == rows[1]["reuse/age_mean"] == 1  # only step 0's batch to replay
    assert all(r["reuse/age_max"] == 2 for r in rows[2:]), "the oldest allowed age was never drawn"
    assert all(r["reuse/buffer_bytes"] > 0 for r in rows)


def test_inspect_buckets_replayed_tokens_by_age(uninterrupted):
    cmd = [sys.executable, "-m", "m2po_cli", "inspect", "ratios", str(uninterrupted / "whole"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["bucket"] for row in report["staleness"]] == ["0", "replayed 1-2"]
    m2po = next(rule for rule in report["rules"] if rule["run_loss"])
    assert set(m2po["frac_by_staleness"]) == {"0", "replayed 1-2"}


def test_a_killed_run_resumes_with_the_same_buffer_and_draws(uninterrupted):
    """Killed mid-run and near its end, then run to the end: every step's metrics (the replayed
    share, ages, losses) and the exported weights are the uninterrupted run's, bit for bit."""
    from tests.train.test_determinism import compared, exported, first_difference

    out = uninterrupted
    for lines in (3, 7):
        killed_when(out, "killed", lines, *REPLAY)
    subprocess.run(
        train_command(out, "killed", *REPLAY), check=True, capture_output=True, env=env(), timeout=900
    )
    assert list((out / "killed" / "checkpoints").glob("step-*/replay-00000-of-00001.safetensors"))
    whole, killed = compared(out / "whole"), compared(out / "killed")
    assert [r["step"] for r in killed] == list(range(10)), "a step was lost or repeated"
    assert first_difference(whole, killed) is None
    assert exported(out / "whole") == exported(out / "killed") is not None


def test_epochs_train_each_batch_as_many_times(tmp_path):
    """Two passes of two mini-batches: four updates a step, each token trained twice, the second
    time two updates later."""
    run = train(
        recipe_for(
            tmp_path,
            "run.steps=3",
            "rollout.prompts_per_step=8",
            "rollout.n=4",
            "train.mini_batch_prompts=4",
            "staleness.s=0",
            'reuse={mode="epochs", epochs=2}',
            "checkpoint.every=0",
        )
    )
    for r in metrics(run):
        assert r["optim/version"] == 4 * (r["step"] + 1)
        assert (r["staleness/min"], r["staleness/max"]) == (0, 3)
        assert r["staleness/mean"] == pytest.approx(1.5, abs=0.5)
