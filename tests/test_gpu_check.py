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
