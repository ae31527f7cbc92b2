"""Rollout engines under torchrun (2 CPU ranks): one per rank, or one tensor-parallel engine over
both; shares, pushes and probes on each rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2po_cli.models import resolve_model
from m2po_cli.rollout.settings import request_seed
from m2po_cli.schedule import Schedule
from m2po_cli.train.packed import owners

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_engine_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def run_worker(out: Path, tp: int) -> list[dict]:
    """`dist_engine_worker.py` under torchrun with 2 CPU ranks; each rank's record."""
    resolve_model("builtin:tiny-qwen3")  # build once, not once per rank
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*cmd, str(WORKER), str(out), str(tp)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def assert_follows_every_push(rec: dict) -> None:
    # Before any update and after each of the two pushes, the engine scores as the learner does.
    assert len(rec["gaps"]) == 3 and max(rec["gaps"]) < 1e-4, rec["gaps"]
    # Each update moved the probe visibly, and the engine noticed the push it had not received.
    assert min(rec["stale"]) > 1e-3, rec["stale"]
    assert rec["skips_caught"] == 2


@pytest.mark.slow
def test_each_rank_generates_its_share_and_follows_every_push(tmp_path):
    ranks = run_worker(tmp_path, tp=1)

    # The train loop's rollout step: each rank's engine sampled its own half of the batch's prompts,
    # each prompt with its own seed ...
    batch_prompts, n = ranks[0]["rollout"]["batch_prompts"], 8
    sampled = {}  # (prompt, sample) -> response tokens, from whichever engine sampled them
    for r, rec in enumerate(ranks):
        assert rec["rollout"]["batch_prompts"] == batch_prompts
        (asked,) = rec["rollout"]["asked"]
        assert asked["prompts"] == batch_prompts[2 * r : 2 * r + 2], f"rank {r} sampled other prompts"
        for i, group in enumerate(asked["responses"]):
            sampled.update({(2 * r + i, g): response for g, response in enumerate(group)})
    seeds = [seed for rec in ranks for seed in rec["rollout"]["asked"][0]["seeds"]]
    assert seeds == [request_seed(0, 0, i) for i in range(4)], "seeded by the run's seed, step and prompt"
    # ... and each rank then holds the rows it trains, in row order: together every row once, each
    # on the rank `owners` deals it to by length (2 updates of 2 prompts), each row the prompt and
    # the response its engine sampled.
    held = {
        row: (r, len(tokens))
        for r, rec in enumerate(ranks)
        for row, tokens in zip(rec["rollout"]["rows"], rec["rollout"]["row_tokens"], strict=True)
    }
    row_N = torch.tensor(sorted(held))
    assert row_N.tolist() == list(range(4 * n))
    dealt = owners(row_N, torch.tensor([held[i][1] for i in row_N.tolist()]), Schedule(4, 2, n), 2)
    assert dealt.tolist() == [held[i][0] for i in row_N.tolist()]
    for r, rec in enumerate(ranks):
        rows = rec["rollout"]
        assert rows["rows"] == sorted(rows["rows"])
        for row, tokens, prompt_len in zip(rows["rows"], rows["row_tokens"], rows["prompt_len"], strict=True):
            prompt, sample = divmod(row, n)
            assert tokens == batch_prompts[prompt] + sampled[prompt, sample], f"row {row} on rank {r}"
            assert prompt_len == len(batch_prompts[prompt])
    print(f"train.colocated.rollout of 4 prompts x {n} on 2 ranks, grader start-up included: ", end="")
    print(", ".join(f"rank {r} {rec['rollout']['seconds']:.1f} s" for r, rec in enumerate(ranks)))
    # The timings are the slowest engine's and grader's, the same on every rank.
    for key in ("time/generate", "time/grade"):
        assert ranks[0]["rollout"]["meta"][key] == ranks[1]["rollout"]["meta"][key] > 0, key

    for r, rec in enumerate(ranks):
        assert rec["world"] == 2
        for step in rec["generated"]:  # rank 0 samples prompts 0-1, rank 1 prompts 2-3, n each
            assert [i for i, _ in step] == [2 * r, 2 * r + 1]
            assert all(len(group) == 8 and all(len(t) > 0 for t in group) for _, group in step)
        assert rec["embedding_rows"] == rec["vocab"]
        assert_follows_every_push(rec)


@pytest.mark.slow
def test_a_tensor_parallel_engine_over_both_ranks_follows_every_push(tmp_path):
    ranks = run_worker(tmp_path, tp=2)
    for rec in ranks:
        # One engine over the two ranks: each holds half the embedding, and the push loads its half.
        assert rec["world"] == 2 and 2 * rec["embedding_rows"] >= rec["vocab"] > rec["embedding_rows"]
        for step in rec["generated"]:  # the one engine samples all 4 prompts, n each
            assert [i for i, _ in step] == [0, 1, 2, 3]
            assert all(len(group) == 8 and all(len(t) > 0 for t in group) for _, group in step)
        assert_follows_every_push(rec)
    assert ranks[0]["generated"] == ranks[1]["generated"], "the ranks of one engine saw different samples"
