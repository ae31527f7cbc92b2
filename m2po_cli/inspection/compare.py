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

Figures (`write_figures`): the reward, and the clipped or masked share, against optimizer updates,
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
import tomllib
from dataclasses import dataclass
from pathlib import Path

from m2po_cli.errors import UserError

# What a run's recipe may differ in and still be a seed of the same arm.
NOT_THE_ARM = {"run": ("seed", "name", "output_dir"), "logging": None, "checkpoint": None, "inspect": None}
NUMBERS = (
    "reward_first", "reward_last", "reward_peak", "reward_versions", "acted", "abs_log_ratio", "seconds_per_step",
    "tokens", "seconds",
)  # fmt: skip
BEHAVIOUR = "staleness/behaviour_version"  # the oldest policy version that sampled the step's rollouts
# Colocated runs: the batch each step generates (trained s updates later), and its policy version.
NEWEST_REWARD, NEWEST_VERSION = "rollout/newest_reward_mean", "staleness/newest_version"


class CompareError(UserError):
    """A run `m2po compare` cannot read or compare; one line."""


@dataclass
class Run:
    path: Path
    config: dict
    steps: list[dict]

    @property
    def loss(self) -> str:
        loss = self.config.get("loss", {})
        kind = loss.get("type", "m2po")
        return f"{kind} tau={loss['tau']:g}" if "tau" in loss else kind

    @property
    def staleness(self) -> str:
        s = self.config.get("staleness", {})
        if self.config.get("rollout", {}).get("mode") == "separate":
            return f"<={s.get('max_staleness', 4)}"
        return str(s.get("s", 0))

    @property
    def s(self) -> int | None:
        """The fixed staleness of a colocated run; None for separate mode (a bound, not a value)."""
        if self.config.get("rollout", {}).get("mode") == "separate":
            return None
        return int(self.config.get("staleness", {}).get("s", 0))

    @property
    def reuse(self) -> str:
        """The run's `[reuse]`, as a label's suffix: empty when off."""
        r = self.config.get("reuse", {})
        mode = r.get("mode", "off")
        if mode == "epochs":
            return f", {r.get('epochs', 2)} epochs"
        if mode == "replay":
            return f", replay {r.get('replay', 1.0):g} {r.get('rule', 'uniform')} of {r.get('buffer', 4)}"
        return ""

    @property
    def seed(self) -> int:
        return int(self.config.get("run", {}).get("seed", 0))

    def arm_key(self) -> str:
        tree = {}
        for table, value in self.config.items():
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
        return json.dumps(self.config.get("data", {}), sort_keys=True)


def read_run(path: Path) -> Run:
    """A run directory's recipe and steps. Raises CompareError naming the file and the fault."""
    config_path, metrics_path = path / "config.toml", path / "metrics.jsonl"
    if not config_path.is_file():
        raise CompareError(f"{path}: not a run directory (no config.toml; `m2po train` writes one)")
    try:
        config = tomllib.loads(config_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CompareError(f"{config_path}: not a valid run config ({e})") from None
    text = metrics_path.read_text() if metrics_path.is_file() else ""
    if not text.strip():
        raise CompareError(f"{metrics_path}: no steps logged")
    if not text.endswith("\n"):
        raise CompareError(f"{metrics_path}: its last line is cut short (a killed run; resume it to repair)")
    steps = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            raise CompareError(f"{metrics_path}: line {number} is not JSON") from None
        if not isinstance(step, dict) or "step" not in step or "rollout/reward_mean" not in step:
            raise CompareError(f"{metrics_path}: line {number} is not a step's metrics")
        steps.append(step)
    return Run(path, config, steps)


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
    they trained (`BEHAVIOUR`); None if a step logs neither."""
    if all(NEWEST_VERSION in s and NEWEST_REWARD in s for s in run.steps):
        return [(s[NEWEST_VERSION], s[NEWEST_REWARD]) for s in run.steps]
    if all(BEHAVIOUR in s for s in run.steps):
        return [(s[BEHAVIOUR], s["rollout/reward_mean"]) for s in run.steps]
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
    reward = [s["rollout/reward_mean"] for s in run.steps]
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
        "updates": int(run.steps[-1].get("optim/version", n)),
        "reward_first": _mean(reward[:fifth]),
        "reward_last": _mean(reward[-fifth:]),
        "reward_peak": max(_mean(reward[i : i + w]) for i in range(n - w + 1)),
        "reward_versions": _mean(at_versions),
        "acted": over_steps("loss/clip_frac"),
        "abs_log_ratio": over_steps("loss/abs_log_ratio_mean"),
        "seconds_per_step": over_steps("time/step"),
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
SPENT = {"tokens": "rollout/generated_tokens", "seconds": "time/step"}  # summed over the steps


def spent(run: Run, x: str) -> list[float] | None:
    """What the run has spent after each step on the x-axis `x`: updates done (`optim/version`), or
    the generated tokens or wall seconds of the steps so far; None if a step does not log them."""
    if x == "updates":
        return [float(s.get("optim/version", i + 1)) for i, s in enumerate(run.steps)]
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
                float(s.get("optim/version", i + 1)): c
                for i, (s, c) in enumerate(zip(run.steps, costs, strict=True))
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


FIGURES = {  # name: (series key, title, y label, scale); the x-axis names what each is drawn against
    "reward": ("rollout/reward_mean", "reward of the trained batches", "reward (mean over the batch)", 1.0),
    "clipped_or_masked": ("loss/clip_frac", "clipped or masked share", "tokens clipped or masked (%)", 100.0),
    "policy_reward": (
        POLICY,
        "reward of each policy version's samples",
        "reward of the policy's samples",
        1.0,
    ),
}
# Ten colours, then the same ten dashed, then dotted: every arm of a sweep has a line of its own.
LINE_STYLES = ("-", "--", ":")
NUM_COLOURS = 10


def _style(i: int) -> dict:
    """The i-th line's colour and line style (`LINE_STYLES`)."""
    return {"color": f"C{i % NUM_COLOURS}", "linestyle": LINE_STYLES[i // NUM_COLOURS % len(LINE_STYLES)]}


def figures(runs: list[Run], x: str = "updates"):
    """One matplotlib figure per entry of FIGURES against the x-axis `x` (`X_AXES`): a line per
    arm, a band over its seeds (no `policy_reward` if a run does not log its batches' versions;
    none at all if a run does not log what `x` counts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = group(runs)
    out = {}
    for name, (key, title, ylabel, scale) in FIGURES.items():
        if any(series(run, key, x) is None for run in runs):
            continue
        xlabel = "policy version (optimizer updates)" if key == POLICY and x == "updates" else X_AXES[x]
        many = len(arms) > 4  # the legend beside the axes, not over the lines
        fig, ax = plt.subplots(figsize=(10.4 if many else 6.4, 4.0), dpi=150)
        for i, (label, members) in enumerate(arms):
            xs, mean, low, high = curves(members, key, x)
            (line,) = ax.plot(
                xs,
                [scale * v for v in mean],
                **_style(i),
                label=f"{label} ({len(members)} seed{'s' if len(members) > 1 else ''})",
            )
            if len(members) > 1:
                ax.fill_between(
                    xs, [scale * v for v in low], [scale * v for v in high], color=line.get_color(), alpha=0.2
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n(mean over windows of a tenth of the run)", fontsize="medium")
        ax.grid(alpha=0.3)
        if many:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        else:
            ax.legend(fontsize="small")
        fig.tight_layout()
        out[name] = fig
    return out


CURVE_FIGURES = {  # name: (curve key, title, y label, scale)
    "staleness-reward": (
        "reward_versions",
        "reward by policy version",
        "reward (mean ± s.e. over seeds)",
        1.0,
    ),
    "staleness-clipped_or_masked": (
        "acted",
        "clipped or masked share",
        "tokens clipped or masked (%)",
        100.0,
    ),
}


def curve_figures(curve: list[dict]):
    """The staleness curve's figures: a line per loss through its points (error bars: one standard
    error over the seeds), s evenly spaced on the x-axis in the order of its values; a dotted level
    across the figure where a line has an s = 0 point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = sorted({p["s"] for line in curve for p in line["points"]})
    out = {}
    for name, (key, title, ylabel, scale) in CURVE_FIGURES.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=150)
        for i, line in enumerate(curve):
            points = [p for p in line["points"] if p[key] is not None]
            ax.errorbar(
                [values.index(p["s"]) for p in points],
                [scale * p[key] for p in points],
                yerr=[scale * (p[f"{key}_se"] or 0.0) for p in points],
                **_style(i),
                marker="o",
                capsize=3,
                label=line["line"],
            )
            if points and points[0]["s"] == 0:  # the line's on-policy level, across the curve
                ax.axhline(scale * points[0][key], color=_style(i)["color"], linestyle=":", alpha=0.6)
        ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlabel("staleness s (optimizer updates)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} against staleness")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out[name] = fig
    return out


def write_figures(
    runs: list[Run], folder: Path, x: str = "updates", curve: list[dict] | None = None
) -> list[Path]:
    """The figures as PNG files (`<name>.png`; on another x-axis than updates `<name>-by-<x>.png`),
    and a staleness curve's (`staleness-<name>.png`; `compare(runs)["curve"]`) if it has lines."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    made = {
        (f"{name}.png" if x == "updates" else f"{name}-by-{x}.png"): fig
        for name, fig in figures(runs, x).items()
    }
    made |= {f"{name}.png": fig for name, fig in curve_figures(curve).items()} if curve else {}
    for name, fig in made.items():
        path = folder / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


# --- the tables ------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".3f", scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, fmt)


def _pm(row: dict, key: str, fmt: str = ".3f", scale: float = 1.0) -> str:
    se = row.get(f"{key}_se")
    return _f(row[key], fmt, scale) + ("" if se is None else f" ± {_f(se, fmt, scale)}")


def _versions_column(report: dict) -> str:
    """The header of the by-version reward: the policy versions it averages."""
    versions = report["versions"]
    return "reward, versions -" if versions is None else f"reward, versions {versions[0]}-{versions[1]}"


def run_table(report: dict):
    from rich.table import Table

    t = Table(title="runs", title_justify="left")
    for name in ("run", "loss", "s", "seed", "steps", "updates", "reward first 1/5", "last 1/5", "peak",
                 _versions_column(report), "clipped/masked %", "mean |log r|", "s/step", "generated tokens",
                 "wall s"):  # fmt: skip
        t.add_column(name, justify="left" if name in ("run", "loss") else "right", no_wrap=True)
    for r in report["runs"]:
        t.add_row(
            r["run"], r["loss"], r["staleness"], str(r["seed"]), str(r["steps"]), str(r["updates"]),
            _f(r["reward_first"]), _f(r["reward_last"]), _f(r["reward_peak"]), _f(r["reward_versions"]),
            _f(r["acted"], ".2f", 100), _f(r["abs_log_ratio"], ".4f"), _f(r["seconds_per_step"], ".2f"),
            _f(r["tokens"], ",.0f"), _f(r["seconds"], ".0f"),
        )  # fmt: skip
    return t


def arm_table(report: dict):
    from rich.table import Table

    t = Table(title="arms: mean ± standard error over seeds", title_justify="left")
    for name in ("arm", "seeds", "steps", "reward first 1/5", "last 1/5", "peak", _versions_column(report),
                 "clipped/masked %", "mean |log r|", "s/step", "generated tokens", "wall s"):  # fmt: skip
        t.add_column(name, justify="left" if name == "arm" else "right", no_wrap=True)
    for a in report["arms"]:
        t.add_row(
            a["arm"], str(len(a["seeds"])), str(a["steps"]), _pm(a, "reward_first"), _pm(a, "reward_last"),
            _pm(a, "reward_peak"), _pm(a, "reward_versions"), _pm(a, "acted", ".2f", 100),
            _pm(a, "abs_log_ratio", ".4f"), _pm(a, "seconds_per_step", ".2f"), _pm(a, "tokens", ",.0f"),
            _pm(a, "seconds", ".0f"),
        )  # fmt: skip
    return t


def curve_table(report: dict):
    """The staleness curve: a row per line, a column per s, each cell the reward by policy version
    (mean ± standard error over the seeds) and the clipped or masked share."""
    from rich.table import Table

    curve = report["curve"]
    values = sorted({p["s"] for line in curve for p in line["points"]})
    t = Table(title=f"by staleness: {_versions_column(report)} / clipped or masked %", title_justify="left")
    t.add_column("loss", no_wrap=True)
    for v in values:
        t.add_column(f"s={v}", justify="right", no_wrap=True)
    for line in curve:
        at = {p["s"]: p for p in line["points"]}
        t.add_row(line["line"], *[
            f"{_pm(at[v], 'reward_versions')} / {_pm(at[v], 'acted', '.2f', 100)} ({at[v]['seeds']})" if v in at else "-"
            for v in values
        ])  # fmt: skip
    return t


def command(run_dirs: tuple[str, ...], as_json: bool, plot_dir: str | None, x: str = "updates") -> None:
    """`m2po compare`: tables (or JSON) on stdout, PNG figures against `x` into `plot_dir`."""
    from rich.console import Console

    from m2po_cli.inspection.report import print_whole

    runs = read_runs([Path(p) for p in run_dirs])
    report = compare(runs)
    if plot_dir is not None:
        missing = [str(run.path) for run in runs if spent(run, x) is None]
        if missing:
            raise CompareError(f"{missing[0]}: its steps do not log {SPENT[x]}, which --x {x} plots against")
        report["plots"] = [str(p) for p in write_figures(runs, Path(plot_dir), x, report["curve"])]
    console = Console()
    if as_json:
        console.file.write(json.dumps(report, indent=1) + "\n")
        return
    print_whole(console, run_table(report))
    print_whole(console, arm_table(report))
    if report["curve"]:
        print_whole(console, curve_table(report))
    for path in report.get("plots", []):
        console.print(f"wrote {path}")
