"""The tables of `m2po inspect ratios`, rendered from `ratios.analyse`'s report (rich, like `m2po eval`)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _num(value: float | None, fmt: str = ".4f") -> str:
    """`fmt`, or two significant digits for values too small for it (engine mismatch is ~1e-6)."""
    if value is None:
        return "-"
    return f"{value:.1e}" if 0 < abs(value) < 1e-3 and fmt.endswith("f") else format(value, fmt)


def header(report: dict, run_dir: str, loss: str) -> str:
    steps = report["steps"]
    return (
        f"{run_dir}: steps {steps[0]}-{steps[-1]}, {report['num_updates']} recorded updates, "
        f"{report['num_sequences']} sequences, {report['num_tokens']} tokens; loss {loss}, "
        f"behaviour logprobs from the {report['behaviour']}"
    )


def staleness_table(report: dict) -> Table:
    return _log_r_table(report["staleness"], report["all"], "log r by staleness (in updates)", "s")


def turns_table(report: dict) -> Table | None:
    """Episodes of several turns: log r of each model turn's tokens."""
    if "turns" not in report:
        return None
    return _log_r_table(report["turns"], report["all"], "log r by the episode's model turn", "turn")


def _log_r_table(rows: list[dict], all_row: dict, title: str, first: str) -> Table:
    t = Table(title=title, title_justify="left")
    for name in (first, "updates", "tokens", "rms log r", "mismatch", "drift", "ESS/N", "M2 TR"):
        t.add_column(name, justify="left" if name == first else "right", no_wrap=True)
    for row in rows + [{**all_row, "bucket": "all"}]:
        t.add_row(
            row["bucket"],
            str(row["num_updates"]),
            str(row["num_tokens"]),
            _num(row["rms_log_ratio"]),
            _num(row["rms_mismatch"]),
            _num(row["rms_drift"]),
            _num(row["ess_frac"], ".3f"),
            _num(row["m2_trust_region"], ".5f"),
            end_section=row["bucket"] == rows[-1]["bucket"],
        )
    return t


def quantile_table(report: dict) -> Table:
    q = report["quantiles"]
    t = Table(title="quantiles of the importance ratio", title_justify="left")
    t.add_column("")
    for name in q:
        t.add_column(name, justify="right")
    t.add_row("log r", *(f"{v:+.4f}" for v in q.values()))
    t.add_row("r", *(f"{math.exp(v):.4f}" for v in q.values()))
    return t


def rules_table(report: dict) -> Table:
    t = Table(title="tokens each rule clips or masks (% of tokens)", title_justify="left")
    t.add_column("rule", no_wrap=True)
    for name in ("all", "A > 0", "A < 0", "entropy", "M2 after"):
        t.add_column(name, justify="right")
    for rule in report["rules"]:
        t.add_row(
            _rule_label(rule),
            _pct(rule["frac"]),
            _pct(rule["frac_pos"]),
            _pct(rule["frac_neg"]),
            _num(rule["entropy_acted"], ".3f"),
            _num(rule["m2_after"], ".5f"),
        )
    trained = report["as_trained"]
    if trained is not None:
        t.add_section()
        t.add_row(f"{trained['rule']}, as trained", _pct(trained["frac"]), "", "", "", "")
    return t


def rules_by_staleness_table(report: dict) -> Table:
    buckets = [row["bucket"] for row in report["staleness"]]
    return _rules_by(
        report, "frac_by_staleness", buckets, "the same, by staleness (% of the tokens at s)", "s"
    )


def rules_by_turn_table(report: dict) -> Table | None:
    if "turns" not in report:
        return None
    turns = [row["bucket"] for row in report["turns"]]
    return _rules_by(
        report, "frac_by_turn", turns, "the same, by model turn (% of the turn's tokens)", "turn"
    )


def _rules_by(report: dict, key: str, groups: list[str], title: str, prefix: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("rule", no_wrap=True)
    for g in groups:
        t.add_column(f"{prefix} {g}", justify="right")
    for rule in report["rules"]:
        t.add_row(_rule_label(rule), *(_pct(rule[key][g]) for g in groups))
    return t


def _rule_label(rule: dict) -> str:
    return rule["rule"] + (" *" if rule["run_loss"] else "")


def entropy_table(report: dict) -> Table:
    t = Table(title="entropy by |r - 1|", title_justify="left")
    for name in ("|r - 1|", "tokens %", "mean entropy"):
        t.add_column(name, justify="right")
    for row in report["entropy_by_ratio"]:
        span = f"{row['lo']:g} - {row['hi']:g}" if math.isfinite(row["hi"]) else f">= {row['lo']:g}"
        t.add_row(span, _pct(row["frac"]), _num(row["entropy"], ".3f"))
    t.add_section()
    t.add_row("all", _pct(1.0), _num(report["mean_entropy"], ".3f"))
    return t


NOTES = (
    "s: staleness in updates. rms: root mean square. mismatch: learner at the generating version - engine; drift: current - learner at the generating "
    "version (sequences the learner scored at that version). ESS/N = (sum r)^2 / (N sum r^2). M2 TR: "
    "mean (log r)^2 over trust-region tokens. entropy: mean entropy of the tokens the rule acts on. "
    "* the run's own loss, applied to the recorded sequences; 'as trained': what it did to whole batches."
)


def print_whole(console: Console, table: Table) -> None:
    """Print `table` at its natural width, wider than the terminal (or a pipe's 80 columns) where it
    needs to be: rich would otherwise shrink its columns and cut numbers short with an ellipsis."""
    needed = Measurement.get(console, console.options.update_width(100_000), table).maximum
    width = console.width
    try:
        console.width = max(width, needed)
        console.print(table)
    finally:
        console.width = width


def show(report: dict, run_dir: str, loss: str, console: Console) -> None:
    console.print(header(report, run_dir, loss), soft_wrap=True)
    tables = (
        staleness_table,
        turns_table,
        quantile_table,
        rules_table,
        rules_by_staleness_table,
        rules_by_turn_table,
        entropy_table,
    )
    for table in tables:
        if (shown := table(report)) is not None:
            print_whole(console, shown)
    console.print(NOTES, style="dim")
