"""`scripts/gpu_check.sh` in its CPU mode: the same steps as on a GPU, at tiny size, all passing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU mode is run by hand (docs/performance.md)")
def test_gpu_check_passes_in_cpu_mode():
    env = {**os.environ, "M2PO_PYTHON": str(Path(sys.executable))}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--no-write-doc"],
        capture_output=True,
        text=True,
        timeout=1300,
        cwd=ROOT,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert "m2po gpu check, CPU mode (tiny size)" in out and "All checks passed." in out
    for row in (
        "1 rank: M2PO loss per update",
        "1 rank: learner tokens/s",
        "1 rank: weight sync",
        "1 rank: engine vs learner logprob after a push",
        "generation alone, eager",
    ):
        assert f"| {row}" in out, row


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU mode is run by hand (docs/performance.md)")
def test_gpu_check_runs_the_learner_alone_where_asked():
    """`--learner-only` (the default where vLLM is missing): three M2PO updates of the recipe's
    learner on one synthetic batch, the engine's rows listed as not applicable."""
    env = {**os.environ, "M2PO_PYTHON": str(Path(sys.executable))}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--learner-only", "--no-write-doc"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert "m2po gpu check, CPU mode (tiny size), learner alone" in out and "All checks passed." in out
    losses = next(
        line for line in out.splitlines() if line.startswith("| learner alone: M2PO loss per update")
    )
    values = [float(x) for x in losses.split("|")[2].split(",")]
    assert len(values) == 3 and len(set(values)) == 3  # three updates, each moving the policy
    assert "| learner alone: seconds per update; tokens/s" in out
    assert "not applicable: the engine" in out and "| 1 rank:" not in out
