"""`scripts/gpu_check.sh` in its CPU mode: the same steps as on a GPU, at tiny size, all passing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str, timeout: int) -> tuple[str, subprocess.CompletedProcess]:
    """`scripts/gpu_check.sh --no-write-doc *args` with this interpreter; its stdout and the process."""
    env = {**os.environ, "M2PO_PYTHON": str(Path(sys.executable))}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--no-write-doc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    return done.stdout, done


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU mode is run by hand (docs/performance.md)")
def test_gpu_check_passes_in_cpu_mode():
    out, done = run_check(timeout=1300)
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
    out, done = run_check("--learner-only", timeout=600)
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert "m2po gpu check, CPU mode (tiny size), learner alone" in out and "All checks passed." in out
    losses = next(
        line for line in out.splitlines() if line.startswith("| learner alone: M2PO loss per update")
    )
    values = [float(x) for x in losses.split("|")[2].split(",")]
    assert len(values) == 3 and len(set(values)) == 3  # three updates, each moving the policy
    assert "| learner alone: learner tokens/s" in out and "| learner alone: seconds per update" in out
    assert "not applicable: the engine" in out and "| 1 rank:" not in out
