"""The 8B colocated recipe's device-memory budget (bench/memory_budget.py, from the code's sizes):
at least 5 GB free after each wake and during the push on an 80 GB GPU, the check can fail, and the
learner's training peak it predicts is within 5% of the one GPU measurement (docs/performance.md)."""

import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "memory_budget.py"


def budget(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@functools.cache
def default_budget() -> subprocess.CompletedProcess:
    return budget()


def free_gb(output: str, phase: str) -> tuple[float, float]:
    """(free, free without releasing cached blocks) of one phase's row."""
    row = next(line for line in output.splitlines() if line.startswith(f"| {phase} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return float(re.match(r"~([\d.]+) GB", cells[3])[1]), float(re.match(r"~([\d.]+) GB", cells[4])[1])


def test_the_8b_recipe_wakes_with_5_gb_free_on_an_80_gb_gpu():
    done = default_budget()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8.19 B parameters, 8 ranks, 80 GB GPU, micro-batch 16,384 tokens" in done.stdout
    for phase in ("wake: weights", "push (largest tensor in flight)", "wake: KV cache"):
        free, unreleased = free_gb(done.stdout, phase)
        assert free >= 5.0, (phase, free)
        assert unreleased < free, phase  # the allocator's cache would take room from the engine
    assert "131 GB for 8 ranks; level 2: none" in done.stdout


def test_the_learner_peak_is_within_5_percent_of_the_h200_measurement():
    done = default_budget()
    line = next(line for line in done.stdout.splitlines() if "measured on 1 x H200" in line)
    measured, predicted, error = re.search(
        r"measured ([\d.]+) GB, predicted ([\d.]+) GB .*error ([-+][\d.]+)%", line
    ).groups()
    assert float(measured) == 42.3
    assert abs(float(error)) <= 5.0, line
    assert abs(float(predicted) / float(measured) - 1) <= 0.05, line


def test_the_budget_check_fails_below_its_margin_or_without_a_kv_cache():
    done = budget("--margin-gb", "40")
    assert done.returncode == 1 and "(FAILED: margin 40 GB)" in done.stdout
    done = budget("--gpu-gb", "40")  # half of 40 GB does not hold 16.4 GB of weights and the rest
    assert done.returncode == 1 and "leaves no KV cache: FAILED" in done.stdout
