"""`scripts/gpu_check.sh` in its CPU mode: the same steps as on a GPU, at tiny size, all passing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


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
def test_gpu_check_passes_in_cpu_mode(tmp_path):
    report = tmp_path / "report.md"
    out, done = run_check("--report", str(report), timeout=1300)
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert "m2po gpu check, CPU mode (tiny size)" in out and "All checks passed." in out
    assert report.read_text().rstrip().endswith("All checks passed.")
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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU mode is run by hand (docs/performance.md)")
def test_a_check_killed_at_its_limit_leaves_the_rows_of_the_phases_it_finished(tmp_path):
    """Killed (as `timeout` kills it) once the train phase has begun: the report holds the model's
    row and says where it stopped."""
    report = tmp_path / "report.md"
    env = {**os.environ, "M2PO_PYTHON": str(Path(sys.executable))}
    cmd = ["bash", "scripts/gpu_check.sh", "--no-write-doc", "--report", str(report)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "'1-rank train' began" not in (report.read_text() if report.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the train phase never began"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = report.read_text()
    assert "| model | Qwen3, hidden" in text and "All checks passed." not in text
    assert text.rstrip().endswith("these rows were written when the phase '1-rank train' began.")


def test_the_checks_children_keep_the_callers_pythonpath(monkeypatch):
    """A machine without network brings packages through PYTHONPATH; the train child must see them."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from gpu_check import child_env
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/carried", "/opt/more"]))
    paths = child_env()["PYTHONPATH"].split(os.pathsep)
    assert paths == [str(ROOT), str(ROOT / "bench"), "/opt/carried", "/opt/more"]
