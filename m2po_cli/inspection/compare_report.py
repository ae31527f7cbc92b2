"""`m2po compare`'s tables (rich): the runs, the arms (mean ± standard error over seeds) and the
staleness curve."""

from __future__ import annotations


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
