"""`m2po compare`: runs side by side from their metrics alone, seeds of one recipe as one arm; its
numbers against literal recomputations from metrics.jsonl, its figures, its one-line refusals."""

from __future__ import annotations

import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from m2po_cli.config import load_recipe
from m2po_cli.config.tables import to_toml
from m2po_cli.inspection.compare import compare, read_runs
from m2po_cli.inspection.compare_plots import curve_figures, figures
from m2po_cli.inspection.report import print_whole
from tests.conftest import QUICKSTART

ROOT = Path(__file__).resolve().parents[2]
ARMS = {
    "m2po": ['loss={type="m2po", tau=0.04}', "staleness.s=8"],
    "grpo": ['loss={type="grpo"}', "staleness.s=8"],
}


def fake_run(folder: Path, arm: str, seed: int, steps: int = 23, *extra: str, newest: bool = False) -> Path:
    """A run directory as `m2po train` leaves it: its resolved recipe and one metrics line a step
    (`newest`: with the reward of the batch each step generates, as colocated runs log it)."""
    recipe = load_recipe(QUICKSTART, [*ARMS[arm], f"run.seed={seed}", f'run.name="{arm}-{seed}"', *extra])
    run = folder / f"{arm}-{seed}"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(recipe))
    lines = []
    for step in range(steps):
        x = (step * 7 + seed * 13 + len(arm)) % 11 / 10
        lines.append({
            "step": step, "optim/version": step + 1, "rollout/reward_mean": x * (1 + step / steps),
            "loss/clip_frac": 0.001 * ((step + seed) % 5) * (10 if arm == "grpo" else 1),
            "loss/abs_log_ratio_mean": 0.01 + 0.001 * step, "time/step": 0.4 + 0.01 * seed,
            "staleness/behaviour_version": float(max(0, step - recipe.staleness.s)),
            "rollout/generated_tokens": 100.0 + 10 * seed,
        })  # fmt: skip
        if newest:
            lines[-1] |= {
                "staleness/newest_version": float(step),
                "rollout/newest_reward_mean": newest_reward(step, seed),
            }
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def newest_reward(step: int, seed: int) -> float:
    return 0.3 + 0.02 * step + 0.007 * ((step * 5 + seed) % 3)


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [fake_run(tmp_path, arm, seed) for arm in ARMS for seed in (0, 1, 2)]


def literal(run: Path) -> dict:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reward = [s["rollout/reward_mean"] for s in steps]
    n, k, w = len(reward), max(1, len(reward) // 5), max(1, len(reward) // 10)
    return {
        "reward_first": sum(reward[:k]) / k,
        "reward_last": sum(reward[-k:]) / k,
        "reward_peak": max(sum(reward[i : i + w]) / w for i in range(n - w + 1)),
        "acted": sum(s["loss/clip_frac"] for s in steps) / n,
        "abs_log_ratio": sum(s["loss/abs_log_ratio_mean"] for s in steps) / n,
        "seconds_per_step": sum(s["time/step"] for s in steps) / n,
    }


def test_numbers_are_the_metrics_recomputed_and_seeds_form_arms(runs):
    report = compare(read_runs(runs))
    assert [r["run"] for r in report["runs"]] == [str(r) for r in runs]
    for row, run in zip(report["runs"], runs, strict=True):
        assert row["steps"] == 23 and row["updates"] == 23 and row["staleness"] == "8"
        for key, value in literal(run).items():
            assert row[key] == pytest.approx(value, rel=1e-12), (run.name, key)
    assert [a["arm"] for a in report["arms"]] == ["m2po tau=0.04, s=8", "grpo, s=8"]
    for arm, name in zip(report["arms"], ARMS, strict=True):
        assert arm["seeds"] == [0, 1, 2]
        values = [literal(r)["reward_last"] for r in runs if r.name.startswith(name)]
        assert arm["reward_last"] == pytest.approx(statistics.mean(values), rel=1e-12)
        assert arm["reward_last_se"] == pytest.approx(statistics.stdev(values) / math.sqrt(3), rel=1e-9)


def test_rewards_by_policy_version_are_of_the_versions_every_run_sampled(tmp_path):
    """Stale runs (s = 8) reach version 14 in 23 steps, on-policy ones version 22: both are read at
    the last 4 (a fifth of 23 steps) versions the stale ones reached, 11-14."""
    stale = [fake_run(tmp_path, "m2po", seed) for seed in (0, 1, 2)]
    fresh = [fake_run(tmp_path, "grpo", seed, 23, "staleness.s=0") for seed in (0, 1)]
    report = compare(read_runs(stale + fresh))
    assert report["versions"] == [11, 14]
    for row, run in zip(report["runs"], stale + fresh, strict=True):
        reward = [
            json.loads(line)["rollout/reward_mean"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]
        steps = range(19, 23) if run in stale else range(11, 15)  # the steps that sampled versions 11-14
        assert row["reward_versions"] == pytest.approx(sum(reward[i] for i in steps) / 4, rel=1e-12), run.name
    fresh_arm = report["arms"][1]
    values = [r["reward_versions"] for r in report["runs"][3:]]
    assert fresh_arm["arm"] == "grpo, s=0" and fresh_arm["reward_versions"] == pytest.approx(
        statistics.mean(values)
    )
    assert fresh_arm["reward_versions_se"] == pytest.approx(statistics.stdev(values) / math.sqrt(2))
    # a run that does not log its steps' versions: no by-version reward, for any run
    lines = (fresh[0] / "metrics.jsonl").read_text().splitlines()
    old = [
        json.dumps({k: v for k, v in json.loads(line).items() if k != "staleness/behaviour_version"})
        for line in lines
    ]
    (fresh[0] / "metrics.jsonl").write_text("\n".join(old) + "\n")
    report = compare(read_runs(stale + fresh))
    assert report["versions"] is None and all(r["reward_versions"] is None for r in report["runs"])
    assert set(figures(read_runs(stale + fresh))) == {"reward", "clipped_or_masked"}


def test_colocated_runs_are_read_at_the_versions_their_steps_generated(tmp_path):
    """Runs that log the batch each step generates reach their last policy whatever their staleness:
    stale and on-policy runs of 23 steps are both read at versions 19-22, from those batches."""
    stale = [fake_run(tmp_path, "m2po", seed, newest=True) for seed in (0, 1)]
    fresh = [fake_run(tmp_path, "grpo", seed, 23, "staleness.s=0", newest=True) for seed in (0, 1)]
    report = compare(read_runs(stale + fresh))
    assert report["versions"] == [19, 22]
    for row, run in zip(report["runs"], stale + fresh, strict=True):
        seed = int(run.name[-1])
        expected = sum(newest_reward(step, seed) for step in range(19, 23)) / 4
        assert row["reward_versions"] == pytest.approx(expected, rel=1e-12), run.name
    # beside runs that log only their trained batches, those bound the versions
    report = compare(read_runs([*stale, fake_run(tmp_path / "old", "m2po", 0)]))
    assert report["versions"] == [11, 14]
    expected = sum(newest_reward(step, 0) for step in range(11, 15)) / 4
    assert report["runs"][0]["reward_versions"] == pytest.approx(expected, rel=1e-12)
    fig = figures(read_runs(stale))["policy_reward"]
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_xdata()) == [float(v) for v in range(1, 23, 2)]  # 2-version windows, at their last
    first = statistics.mean((newest_reward(0, seed) + newest_reward(1, seed)) / 2 for seed in (0, 1))
    assert line.get_ydata()[0] == pytest.approx(first, rel=1e-12)


def m2po(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "m2po_cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


WITHOUT_VLLM = """
import sys, time
t0 = time.perf_counter()
from m2po_cli.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith(("vllm.", "torch")))
print(f"loaded: {loaded} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
"""


def test_the_command_prints_whole_numbers_piped_at_80_columns_without_vllm_or_torch(runs, tmp_path):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, "compare", *map(str, runs), "--plot", str(tmp_path / "figs")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # What the command costs is its CPU time (about 1 s here), not a wall clock that a slower or busier
    # machine stretches.
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 10, f"{cpu:.1f} s of CPU"
    assert "loaded: []" in done.stderr  # neither vllm nor torch
    assert "…" not in done.stdout
    report = json.loads(m2po("compare", *map(str, runs), "--json").stdout)
    for row in report["runs"]:
        assert row["run"] in done.stdout and f"{row['reward_last']:.3f}" in done.stdout
    for arm in report["arms"]:
        assert f"{arm['reward_peak']:.3f} ± {arm['reward_peak_se']:.3f}" in done.stdout
        assert f"{arm['reward_versions']:.3f} ± {arm['reward_versions_se']:.3f}" in done.stdout
    assert f"reward, versions {report['versions'][0]}-{report['versions'][1]}" in done.stdout
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "clipped_or_masked.png", "policy_reward.png", "reward.png"
    ]  # fmt: skip


def test_figures_have_a_line_per_arm_labelled_axes_and_a_legend(runs):
    made = figures(read_runs(runs))
    assert set(made) == {"reward", "clipped_or_masked", "policy_reward"}
    for name, fig in made.items():
        (ax,) = fig.axes
        assert len(ax.get_lines()) == 2 and len(ax.collections) == 2  # a mean line and a seed band per arm
        xlabel = "policy version (optimizer updates)" if name == "policy_reward" else "optimizer updates"
        assert ax.get_xlabel() == xlabel and ax.get_ylabel()
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "m2po tau=0.04, s=8 (3 seeds)", "grpo, s=8 (3 seeds)"
        ]  # fmt: skip
    xs = made["reward"].axes[0].get_lines()[0].get_xdata()
    assert list(xs) == [2.0 * i for i in range(1, 12)]  # 2-step windows of 23 steps, at their last update


CURVE_POINTS = {"grpo": (0, 16, 64), "m2po": (16, 64)}  # the staleness sweep's arms: s = 0 once, for GRPO


def staleness_sweep(folder: Path) -> list[Path]:
    """Colocated runs of two losses at several s, 2 or 3 seeds an arm; each run's generated batches
    score `newest_reward` plus an offset of its loss and s, so every point of the curve differs."""
    runs = []
    for arm, values in CURVE_POINTS.items():
        for s in values:
            for seed in range(3 if s == 64 else 2):
                run = fake_run(folder / f"s{s}", arm, seed, 23, f"staleness.s={s}", newest=True)
                steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                for step in steps:
                    step["rollout/newest_reward_mean"] += curve_offset(arm, s)
                (run / "metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))
                runs.append(run)
    return runs


def curve_offset(arm: str, s: int) -> float:
    return -0.001 * s + (0.05 if arm == "m2po" else 0.0)


def test_the_staleness_curve_is_each_arms_reward_by_version_against_s(tmp_path):
    """A line per loss, a point per s: the mean over the arm's seeds of the reward of versions 19-22
    (recomputed from the generated batches) and of the clipped share, with their standard errors."""
    runs = staleness_sweep(tmp_path)
    report = compare(read_runs(runs))
    assert report["versions"] == [19, 22]
    assert [line["line"] for line in report["curve"]] == ["grpo", "m2po tau=0.04"]
    for line, (arm, values) in zip(report["curve"], CURVE_POINTS.items(), strict=True):
        assert [p["s"] for p in line["points"]] == list(values)
        for point in line["points"]:
            seeds = range(point["seeds"])
            assert point["seeds"] == (3 if point["s"] == 64 else 2)
            reward = [
                sum(newest_reward(step, seed) + curve_offset(arm, point["s"]) for step in range(19, 23)) / 4
                for seed in seeds
            ]
            acted = [
                sum(0.001 * ((step + seed) % 5) * (10 if arm == "grpo" else 1) for step in range(23)) / 23
                for seed in seeds
            ]
            for key, values_ in (("reward_versions", reward), ("acted", acted)):
                assert point[key] == pytest.approx(statistics.mean(values_), rel=1e-12), (
                    arm,
                    point["s"],
                    key,
                )
                assert point[f"{key}_se"] == pytest.approx(
                    statistics.stdev(values_) / math.sqrt(len(values_))
                )
    # runs at one staleness have no curve
    assert compare(read_runs([r for r in runs if r.parent.name == "s16"]))["curve"] == []


def test_the_staleness_curve_figures_and_table(tmp_path):
    runs = staleness_sweep(tmp_path / "runs")
    report = compare(read_runs(runs))
    made = curve_figures(report["curve"])
    assert set(made) == {"staleness-reward", "staleness-clipped_or_masked"}
    for name, fig in made.items():
        (ax,) = fig.axes
        assert ax.get_xlabel() == "staleness s (optimizer updates)" and ax.get_ylabel()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "16", "64"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["grpo", "m2po tau=0.04"]
        key, scale = ("reward_versions", 1.0) if name == "staleness-reward" else ("acted", 100.0)
        assert len(ax.containers) == 2  # an error-bar line per loss
        for bars, curve in zip(ax.containers, report["curve"], strict=True):
            line = bars.lines[0]
            assert list(line.get_xdata()) == [[0, 16, 64].index(p["s"]) for p in curve["points"]]
            assert list(line.get_ydata()) == pytest.approx(
                [scale * p[key] for p in curve["points"]], rel=1e-12
            )
    done = m2po("compare", *map(str, runs), "--plot", str(tmp_path / "figs"))
    assert done.returncode == 0, done.stderr
    assert {"staleness-reward.png", "staleness-clipped_or_masked.png"} <= {
        p.name for p in (tmp_path / "figs").iterdir()
    }
    assert "by staleness" in done.stdout
    grpo0 = report["curve"][0]["points"][0]
    assert f"{grpo0['reward_versions']:.3f} ± {grpo0['reward_versions_se']:.3f}" in done.stdout


def test_every_arm_of_a_large_sweep_has_a_line_of_its_own(tmp_path):
    """Twelve arms (M2PO at twelve budgets): past the ten colours, lines differ by style, and every
    arm's line and legend entry is its own."""
    taus = [0.01 * (k + 1) for k in range(12)]
    made = figures(
        read_runs(
            [fake_run(tmp_path / f"tau{k}", "m2po", 0, 23, f"loss.tau={tau}") for k, tau in enumerate(taus)]
        )
    )
    for fig in made.values():
        (ax,) = fig.axes
        lines = ax.get_lines()
        assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == len(lines) == 12
        assert len({t.get_text() for t in ax.get_legend().get_texts()}) == 12


def test_figures_against_tokens_and_seconds_are_against_what_each_run_spent(runs, tmp_path):
    """Seed s generates 100 + 10 s tokens a step in 0.4 + 0.01 s seconds: an arm's x after step k
    is the mean over its seeds of what they spent by then, (k + 1) x 110 tokens, (k + 1) x 0.41 s."""
    for x, per_step, label in (("tokens", 110.0, "generated tokens"), ("seconds", 0.41, "wall seconds")):
        made = figures(read_runs(runs), x)
        assert set(made) == {"reward", "clipped_or_masked", "policy_reward"}
        for fig in made.values():
            (ax,) = fig.axes
            assert ax.get_xlabel() == label
        xs = made["reward"].axes[0].get_lines()[0].get_xdata()  # 2-step windows, at their last step
        assert list(xs) == pytest.approx([per_step * 2 * i for i in range(1, 12)], rel=1e-12)
    done = m2po("compare", *map(str, runs), "--plot", str(tmp_path / "figs"), "--x", "tokens")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "clipped_or_masked-by-tokens.png", "policy_reward-by-tokens.png", "reward-by-tokens.png"
    ]  # fmt: skip
    metrics = runs[0] / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"rollout/generated_tokens"', '"other"'))
    done = m2po("compare", *map(str, runs), "--plot", str(tmp_path / "figs"), "--x", "tokens")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "do not log rollout/generated_tokens" in done.stderr


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no config", "not a run directory (no config.toml"),
        ("empty", "metrics.jsonl: no steps logged"),
        ("cut", "metrics.jsonl: its last line is cut short"),
        ("not json", "metrics.jsonl: line 2 is not JSON"),
        ("other task", "a different task from"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, damage, message):
    good = fake_run(tmp_path, "m2po", 0)
    bad = fake_run(
        tmp_path, "grpo", 1, 23, *(["data.synthetic.max_operand=9"] if damage == "other task" else [])
    )
    metrics = bad / "metrics.jsonl"
    if damage == "no config":
        (bad / "config.toml").unlink()
    elif damage == "empty":
        metrics.write_text("")
    elif damage == "cut":
        metrics.write_text(metrics.read_text()[:-30])
    elif damage == "not json":
        lines = metrics.read_text().splitlines()
        metrics.write_text("\n".join([lines[0], "{oops", *lines[2:]]) + "\n")
    done = m2po("compare", str(good), str(bad))
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_print_whole_never_cuts_a_number_where_rich_would():
    table = Table(title="wide")
    for i in range(14):
        table.add_column(f"column {i}", justify="right")
    table.add_row(*(f"{281.123456 * (i + 1):.6f}" for i in range(14)))
    plain, whole = io.StringIO(), io.StringIO()
    Console(file=plain, width=80).print(table)
    print_whole(Console(file=whole, width=80), table)
    assert "…" in plain.getvalue()  # what rich does at 80 columns
    assert "…" not in whole.getvalue()
    assert all(f"{281.123456 * (i + 1):.6f}" in whole.getvalue() for i in range(14))
