"""`m2po compare`'s figures: the runs' curves against updates, tokens or seconds (a line per arm, a
band over its seeds) and the staleness curve's. matplotlib is imported only to draw."""

from __future__ import annotations

from pathlib import Path

from m2po_cli.inspection.compare import POLICY, X_AXES, Run, curves, group, series
from m2po_cli.run_dir import CLIP_FRAC, REWARD

FIGURES = {  # name: (series key, title, y label, scale); the x-axis names what each is drawn against
    "reward": (REWARD, "reward of the trained batches", "reward (mean over the batch)", 1.0),
    "clipped_or_masked": (CLIP_FRAC, "clipped or masked share", "tokens clipped or masked (%)", 100.0),
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
