"""One rollout engine per rank under torchrun (2 CPU ranks): shares, pushes and probes on each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2po_cli.models import resolve_model

WORKER = Path(__file__).with_name("dist_engine_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_each_rank_generates_its_share_and_follows_every_push(tmp_path):
    resolve_model("builtin:tiny-qwen3")  # build once, not once per rank
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*cmd, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    for r, rec in enumerate(ranks):
        assert rec["world"] == 2
        for step in rec["generated"]:  # rank 0 samples prompts 0-1, rank 1 prompts 2-3, n each
            assert [i for i, _ in step] == [2 * r, 2 * r + 1]
            assert all(len(group) == 8 and all(len(t) > 0 for t in group) for _, group in step)
        # Before any update and after each of the two pushes, the engine scores as the learner does.
        assert len(rec["gaps"]) == 3 and max(rec["gaps"]) < 1e-4, rec["gaps"]
        # Each update moved the probe visibly, and the engine noticed the push it had not received.
        assert min(rec["stale"]) > 1e-3, rec["stale"]
        assert rec["skips_caught"] == 2
