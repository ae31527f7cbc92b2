"""`m2po compare`: several runs side by side, from their `metrics.jsonl` and `config.toml` alone.

No vLLM, no model, no torch. Runs of one recipe that differ only in `run.seed` (and the run's name
and folder, and what it logs or saves) form one arm; an arm's numbers are the mean over its seeds
with the standard error of that mean. Per run:

- reward of the first and the last fifth of its steps (means of `rollout/reward_mean`), and its peak:
  the largest mean over `window` consecutive steps (a tenth of the run, at least one step);
- the share of tokens its loss clipped or masked (`loss/clip_frac`), the mean |log r| of its tokens
  (`loss/abs_log_ratio_mean`) and seconds per step (`time/step`), each a mean over the steps;
- the reward of the rollouts sampled by the same policy versions in every run (`common_versions`):
  a run s updates stale trains, at step t, on the samples of policy t - s, so its logged reward lags
  an on-policy run's by s updates while rewards still rise; by policy version the two are compared
  like for like. A colocated run also logs the batch each step generates, by the policy of that
  step (`policy_rewards`), so its versions reach the run's last policy.

Figures (`compare_plots`): the reward, and the clipped or masked share, against optimizer updates,
and the reward of each policy version's samples against the version; one line per arm (the mean
over its seeds, a band from the lowest to the highest seed).

The staleness curve (`staleness_curve`), when the runs train at several fixed staleness s: each
arm's reward by policy version and clipped or masked share (mean ± standard error over its seeds)
against s, one line per loss (arms that differ only in `staleness.s` share a line).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from m2po_cli import run_dir
from m2po_cli.config import Recipe
from m2po_cli.errors import UserError
from m2po_cli.run_dir import (
    ABS_LOG_RATIO,
    BEHAVIOUR_VERSION,
    CLIP_FRAC,
    GENERATED_TOKENS,
    NEWEST_REWARD,
    NEWEST_VERSION,
    REWARD,
    STEP_SECONDS,
    VERSION,
)

# What a run's recipe may differ in and still be a seed of the same arm.
NOT_THE_ARM = {"run": ("seed", "name", "output_dir"), "logging": None, "checkpoint": None, "inspect": None}
NUMBERS = (
    "reward_first", "reward_last", "reward_peak", "reward_versions", "acted", "abs_log_ratio", "seconds_per_step",
    "tokens", "seconds",
)  # fmt: skip


class CompareError(UserError):
    """A run `m2po compare` cannot read or compare; one line."""


@dataclass
class Run:
    path: Path
    recipe: Recipe
    steps: list[dict]

    @property
    def loss(self) -> str:
        loss = self.recipe.loss
        return f"{loss.type} tau={loss.tau:g}" if hasattr(loss, "tau") else loss.type

    @property
    def staleness(self) -> str:
        return f"<={self.recipe.staleness.max_staleness}" if self.s is None else str(self.s)

    @property
    def s(self) -> int | None:
        """The fixed staleness of a colocated run; None for separate mode (a bound, not a value)."""
        return None if self.recipe.bounded_staleness else self.recipe.staleness.s

    @property
    def reuse(self) -> str:
        """The run's `[reuse]`, as a label's suffix: empty when off."""
        r = self.recipe.reuse
        if r.mode == "epochs":
            return f", {r.epochs} epochs"
        if r.mode == "replay":
            return f", replay {r.replay:g} {r.rule} of {r.buffer}"
        return ""

    @property
    def seed(self) -> int:
        return self.recipe.run.seed

    def arm_key(self) -> str:
        tree = {}
        for table, value in self.recipe.model_dump(mode="json").items():
            if table in NOT_THE_ARM and NOT_THE_ARM[table] is None:
                continue
            if isinstance(value, dict) and table in NOT_THE_ARM:
                value = {k: v for k, v in value.items() if k not in NOT_THE_ARM[table]}
            tree[table] = value
        return json.dumps(tree, sort_keys=True)

    def line_key(self) -> str:
        """`arm_key` without `staleness.s`: the arms of one staleness curve's line."""
        tree = json.loads(self.arm_key())
        tree.get("staleness", {}).pop("s", None)
        return json.dumps(tree, sort_keys=True)

    def task_key(self) -> str:
        return json.dumps(self.recipe.data.model_dump(mode="json"), sort_keys=True)


def read_run(path: Path) -> Run:
    """A run directory's recipe and steps (`run_dir`). Raises RunDirError naming the file and the fault."""
    return Run(path, run_dir.read_recipe(path), run_dir.read_metrics(path))


def read_runs(paths: list[Path]) -> list[Run]:
    """Every run, checked to be of one task (the same `[data]`)."""
    runs = [read_run(p) for p in paths]
    tasks = {r.task_key() for r in runs}
    if len(tasks) > 1:
        first = runs[0]
        other = next(r for r in runs if r.task_key() != first.task_key())
        raise CompareError(
            f"{other.path}: a different task from {first.path} (their [data] tables differ); compare runs of one task"
        )
    return runs


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def window(num_steps: int) -> int:
    """Steps per point of the peak and of the figures' curves: a tenth of the run, at least one."""
    return max(1, num_steps // 10)


def policy_rewards(run: Run) -> list[tuple[float, float]] | None:
    """(policy version, mean reward of a batch it sampled), a pair per step: the batches the steps
    generated where the run logs them (colocated runs: the policy of that step), else the batches
    they trained (`BEHAVIOUR_VERSION`); None if a step logs neither."""
    if all(NEWEST_VERSION in s and NEWEST_REWARD in s for s in run.steps):
        return [(s[NEWEST_VERSION], s[NEWEST_REWARD]) for s in run.steps]
    if all(BEHAVIOUR_VERSION in s for s in run.steps):
        return [(s[BEHAVIOUR_VERSION], s[REWARD]) for s in run.steps]
    return None


def common_versions(runs: list[Run]) -> tuple[int, int] | None:
    """The policy versions [first, last] whose rollouts every run logged, as many as a fifth of the
    shortest run's steps, ending at the newest version every run reached; None if a run does not log
    its batches' versions."""
    pairs = [policy_rewards(run) for run in runs]
    if any(p is None for p in pairs):
        return None
    last = min(int(max(v for v, _ in p)) for p in pairs)
    fifth = max(1, min(len(run.steps) for run in runs) // 5)
    return max(0, last - fifth + 1), last


def summary(run: Run, versions: tuple[int, int] | None = None) -> dict:
    """One run's numbers (the table's row); `versions` from `common_versions`."""
    reward = [s[REWARD] for s in run.steps]
    n, fifth, w = len(reward), max(1, len(reward) // 5), window(len(reward))

    def over_steps(key: str) -> float | None:
        return _mean([s[key] for s in run.steps if key in s])

    at_versions = []
    if versions is not None:
        at_versions = [r for v, r in policy_rewards(run) if versions[0] <= v <= versions[1]]

    return {
        "run": str(run.path),
        "loss": run.loss,
        "staleness": run.staleness,
        "seed": run.seed,
        "steps": n,
        "updates": int(run.steps[-1].get(VERSION, n)),
        "reward_first": _mean(reward[:fifth]),
        "reward_last": _mean(reward[-fifth:]),
        "reward_peak": max(_mean(reward[i : i + w]) for i in range(n - w + 1)),
        "reward_versions": _mean(at_versions),
        "acted": over_steps(CLIP_FRAC),
        "abs_log_ratio": over_steps(ABS_LOG_RATIO),
        "seconds_per_step": over_steps(STEP_SECONDS),
        "tokens": _total(run, "tokens"),
        "seconds": _total(run, "seconds"),
    }


def _total(run: Run, x: str) -> float | None:
    """What the run spent in all on the x-axis `x` (`spent`); None if a step does not log it."""
    costs = spent(run, x)
    return costs[-1] if costs else None


def group(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """Runs grouped into arms, in the order each arm first appears; each arm labelled by its loss,
    staleness and reuse (and its first run's folder where two arms would share a label)."""
    arms: dict[str, list[Run]] = {}
    for run in runs:
        arms.setdefault(run.arm_key(), []).append(run)
    labels = [f"{m[0].loss}, s={m[0].staleness}{m[0].reuse}" for m in arms.values()]
    out = []
    for label, members in zip(labels, arms.values(), strict=True):
        if labels.count(label) > 1:
            label = f"{label} ({members[0].path.name})"
        out.append((label, members))
    return out


def arm_summary(label: str, rows: list[dict]) -> dict:
    """An arm's numbers from its runs' `summary` rows: each the mean over its seeds, with the
    standard error (None for one seed)."""
    out: dict = {"arm": label, "runs": [r["run"] for r in rows], "seeds": [r["seed"] for r in rows]}
    out |= {
        "loss": rows[0]["loss"],
        "staleness": rows[0]["staleness"],
        "steps": min(r["steps"] for r in rows),
    }
    for key in NUMBERS:
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = _mean(values)
        out[f"{key}_se"] = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return out


def compare(runs: list[Run]) -> dict:
    """Everything `m2po compare` shows, as plain numbers (its `--json`)."""
    versions = common_versions(runs)
    rows = {id(run): summary(run, versions) for run in runs}
    arms = [
        (label, members, arm_summary(label, [rows[id(r)] for r in members])) for label, members in group(runs)
    ]
    return {
        "versions": None if versions is None else list(versions),
        "runs": [rows[id(run)] for run in runs],
        "arms": [summary for _, _, summary in arms],
        "curve": staleness_curve(arms),
    }


CURVE = ("reward_versions", "acted")  # what the staleness curve draws against s


def staleness_curve(arms: list[tuple[str, list[Run], dict]]) -> list[dict]:
    """One line per loss: the arms that differ only in `staleness.s`, a point per s (the arm's mean
    and standard error over its seeds of each of `CURVE`). Empty unless the runs span two or more
    values of s (separate-mode runs have none and are left out)."""
    lines: dict[str, dict] = {}
    for _, members, summary in arms:
        run = members[0]
        if run.s is None:
            continue
        label = f"{run.loss}{run.reuse}"
        line = lines.setdefault(run.line_key(), {"line": label, "points": []})
        point = {"s": run.s, "seeds": len(members)}
        line["points"].append(point | {k: summary[k] for key in CURVE for k in (key, f"{key}_se")})
    if len({p["s"] for line in lines.values() for p in line["points"]}) < 2:
        return []
    labels = [line["line"] for line in lines.values()]
    for number, line in enumerate(lines.values()):
        line["points"].sort(key=lambda p: p["s"])
        if labels.count(line["line"]) > 1:
            line["line"] = f"{line['line']} ({number + 1})"
    return list(lines.values())


POLICY = "policy"  # FIGURES' key for the reward against the policy version (`policy_rewards`)


# The x-axes of the figures: what a run has spent by the end of a step.
X_AXES = {
    "updates": "optimizer updates",
    "tokens": "generated tokens",
    "seconds": "wall seconds",
}
SPENT = {"tokens": GENERATED_TOKENS, "seconds": STEP_SECONDS}  # summed over the steps


def spent(run: Run, x: str) -> list[float] | None:
    """What the run has spent after each step on the x-axis `x`: updates done (`optim/version`), or
    the generated tokens or wall seconds of the steps so far; None if a step does not log them."""
    if x == "updates":
        return [float(s.get(VERSION, i + 1)) for i, s in enumerate(run.steps)]
    key = SPENT[x]
    if not all(key in s for s in run.steps):
        return None
    return list(itertools.accumulate(float(s[key]) for s in run.steps))


def series(run: Run, key: str, x: str = "updates") -> list[tuple[float, float]] | None:
    """(x, y) a step: `key` against what the run has spent after the step (`spent`), or for
    `POLICY` the reward of each version's samples against the version (on the updates axis) or
    against what the run had spent when it reached the version, in version order."""
    costs = spent(run, x)
    if costs is None:
        return None
    if key == POLICY:
        pairs = policy_rewards(run)
        if pairs is None:
            return None
        if x != "updates":  # version v is reached after the step whose optim/version is v
            reached = {0.0: 0.0} | {
                float(s.get(VERSION, i + 1)): c for i, (s, c) in enumerate(zip(run.steps, costs, strict=True))
            }
            known = sorted(reached)
            at = lambda v: reached[known[bisect.bisect_right(known, v) - 1]]  # noqa: E731
            pairs = [(at(v), y) for v, y in pairs]
        return sorted(pairs, key=lambda p: p[0])
    return [(c, s.get(key, 0.0)) for c, s in zip(costs, run.steps, strict=True)]


def curves(
    members: list[Run], key: str, x: str = "updates"
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, mean, lowest, highest) over the arm's seeds of `series` averaged over `window` points, on
    the points every seed reached; x is the seeds' mean at each window's last point."""
    points = [series(r, key, x) for r in members]
    n = min(len(p) for p in points)
    w = window(n)
    xs, mean, low, high = [], [], [], []
    for i in range(0, n - w + 1, w):
        values = [_mean([y for _, y in p[i : i + w]]) for p in points]
        xs.append(math.fsum(p[i + w - 1][0] for p in points) / len(points))
        mean.append(math.fsum(values) / len(values))
        low.append(min(values))
        high.append(max(values))
    return xs, mean, low, high
