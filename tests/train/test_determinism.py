"""A colocated run is a function of its recipe: the same seed gives the same metrics and weights, on a
busy machine too, and a run killed at any moment resumes step for step, its export included."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from determinism import compared, exported, first_difference  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))

pytestmark = pytest.mark.slow

QUICKSTART = ROOT / "recipes" / "quickstart.toml"
SHORT = ["run.steps=10", "checkpoint.every=2", 'logging.console="plain"']


def train_command(out: Path, name: str, *more: str) -> list[str]:
    """`m2po train` of the quickstart, 10 steps, with `--set`-style changes `more`."""
    sets = [*SHORT, f'run.name="{name}"', f'run.output_dir="{out}"', *more]
    return [
        sys.executable,
        "-m",
        "m2po_cli",
        "train",
        str(QUICKSTART),
        *[a for s in sets for a in ("--set", s)],
    ]


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def test_the_same_recipe_on_a_busy_machine_gives_the_same_run(tmp_path):
    """`scripts/determinism.py`: two runs, the second beside a process that keeps the other core busy
    (which is when thread timing, and any order it decides, moves)."""
    cmd = [sys.executable, "scripts/determinism.py", str(QUICKSTART), "--steps", "10", "--busy"]
    cmd += ["--out", str(tmp_path), "--set", "checkpoint.every=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("identical: 10 steps") and "the same exported weights" in done.stdout


def killed_when(out: Path, name: str, lines: int, *more: str) -> None:
    """Start the run (`train_command`) and SIGKILL it (and everything it started) once its metrics
    hold `lines` steps (0: as soon as it has started)."""
    metrics = out / name / "metrics.jsonl"
    proc = subprocess.Popen(train_command(out, name, *more), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env(), start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while (len(metrics.read_text().splitlines()) if metrics.exists() else 0) < lines or (
            lines == 0 and not (out / name).exists()
        ):
            assert proc.poll() is None, f"the run ended before it was killed (exit {proc.returncode})"
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize(
    "more",
    [[], ["lora.rank=8", "optim.lr=0.005", "lora.export_merged=true"]],
    ids=["full", "lora"],
)
def test_a_run_killed_at_any_moment_resumes_step_for_step(tmp_path, more):
    """Killed while starting, mid-run (between checkpoints) and near its end, then run to the end:
    every step's metrics and the exported weights (a LoRA run's adapter and merged weights) are the
    uninterrupted run's, bit for bit."""
    run = functools.partial(subprocess.run, check=True, capture_output=True, env=env(), timeout=900)
    run(train_command(tmp_path, "whole", *more))
    for lines in (0, 3, 8):
        killed_when(tmp_path, "killed", lines, *more)
    run(train_command(tmp_path, "killed", *more))
    whole, killed = compared(tmp_path / "whole"), compared(tmp_path / "killed")
    assert [r["step"] for r in killed] == list(range(10)), "a step was lost or repeated"
    assert first_difference(whole, killed) is None
    assert exported(tmp_path / "whole") == exported(tmp_path / "killed") is not None
    if more:
        assert (tmp_path / "killed" / "adapter" / "adapter_model.safetensors").is_file()
        assert whole[-1]["rollout/push_check_mismatch"] < 1e-4
