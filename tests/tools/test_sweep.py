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


def dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SWEEP), *args, "--dry-run"], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_a_grid_makes_an_arm_of_every_recipe_at_every_value_with_its_own_seeds(tmp_path):
    """The staleness sweep's shape: GRPO at s = 0 once, every loss at 16, 64 and 256, one seed but at
    s = 256, seed by seed."""
    folder = ROOT / "recipes" / "staleness"
    done = dry_run(str(folder / "grpo.toml"), str(folder / "m2po.toml"), "--grid", "staleness.s=0,16,64,256",
                   "--exclude", "m2po-s0", "--seeds", "1", "--seeds-for", "*-s256=3",
                   "--out", str(tmp_path / "out"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = [line.split(": ", 1) for line in done.stdout.splitlines()[:-1]]
    arms = ["grpo-s0", "grpo-s16", "grpo-s64", "grpo-s256", "m2po-s16", "m2po-s64", "m2po-s256"]
    expected = [f"{a}-seed0" for a in arms] + [
        f"{loss}-s256-seed{k}" for k in (1, 2) for loss in ("grpo", "m2po")
    ]
    assert [name for name, _ in runs] == expected
    for name, what in runs:
        loss, s = name.split("-")[:2]  # grpo-s16-seed0: its recipe and grid value
        assert what == f"{folder / loss}.toml --set staleness.{s[0]}={s[1:]}"
    assert done.stdout.splitlines()[-1] == "sweep: 11 runs"
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grid", "staleness.s"], "--grid 'staleness.s': expected KEY=V1,V2,..."),
        (["--grid", "staleness.s=16,"], "--grid 'staleness.s=16,': expected KEY=V1,V2,..."),
        (["--seeds-for", "*-s256=0"], "--seeds-for '*-s256=0': expected PATTERN=N with N >= 1"),
        (["--seeds-for", "*-s512=3", "--grid", "staleness.s=16"], "--seeds-for '*-s512' matches no arm"),
        (["--grid", "staleness.s=16,-1"], "staleness.s: must be >= 0 (got -1)"),
        (["--grid", "staleness.s=0,16", "--exclude", "*-s64"], "--exclude '*-s64' matches no arm"),
        (["--grid", "staleness.s=0,16", "--exclude", "grpo*"], "--exclude leaves no arm"),
    ],
)
def test_a_bad_plan_exits_2_in_one_line_before_any_run(args, message):
    done = dry_run(str(ROOT / "recipes" / "reproduce" / "grpo-s32.toml"), *args)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
