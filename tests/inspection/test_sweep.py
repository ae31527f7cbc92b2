"""`scripts/sweep.py`: arms x seeds, one run at a time, resumable, ending with `m2po compare`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "scripts" / "sweep.py"
SHORT = ["run.steps=2", "rollout.prompts_per_step=8", "rollout.n=4", "inspect.every=0",
         "checkpoint.export_hf=false", 'logging.console="plain"']  # fmt: skip


def sweep(out: Path, *recipes: Path) -> subprocess.CompletedProcess:
    sets = [a for s in SHORT for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SWEEP), *map(str, recipes), "--seeds", "2", "--out", str(out), *sets],
        capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_a_sweep_runs_every_arm_and_seed_once_and_compares_them(tmp_path):
    recipes = [ROOT / "recipes" / "quickstart.toml", ROOT / "recipes" / "quickstart-grpo.toml"]
    out = tmp_path / "sweep"
    done = sweep(out, *recipes)
    assert done.returncode == 0, done.stdout + done.stderr
    names = ["quickstart-seed0", "quickstart-grpo-seed0", "quickstart-seed1", "quickstart-grpo-seed1"]
    for name in names:
        config = tomllib.loads((out / name / "config.toml").read_text())
        assert config["run"]["seed"] == int(name[-1]) and config["run"]["name"] == name
        assert len((out / name / "metrics.jsonl").read_text().splitlines()) == 2
    assert "arms: mean ± standard error over seeds" in done.stdout
    figures = ["clipped_or_masked.png", "policy_reward.png", "reward.png"]
    assert sorted(p.name for p in (out / "figures").iterdir()) == figures
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "m2po_cli", "compare", *[str(out / n) for n in names], "--json"],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
        ).stdout
    )  # fmt: skip
    assert [len(a["seeds"]) for a in report["arms"]] == [2, 2]

    again = sweep(out, *recipes)  # resumed: nothing left to train
    assert again.returncode == 0, again.stderr
    assert all(f"{name}: done already" in again.stdout for name in names)
    assert all(len((out / n / "metrics.jsonl").read_text().splitlines()) == 2 for n in names)
