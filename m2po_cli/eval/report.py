"""Scores and tables of `m2po eval`: avg@n, unbiased pass@k, the rich table and its markdown twin.

avg@n is the mean correctness over the n samples of every evaluated problem (the paper's "mean
accuracy over 16 samples per problem for AIME, 4 for the rest"). pass@k is the unbiased estimator of
Chen et al. (2021), 1 - C(n-c, k) / C(n, k) per problem with c of n samples correct, averaged over
problems. A target's "average" is the unweighted mean of avg@n over its benchmarks, as Table 1's Avg.
Problems whose prompt did not fit the model are skipped and counted, never scored.
"""

from __future__ import annotations

import math
from statistics import fmean
from typing import TYPE_CHECKING, Any

from rich.table import Table

if TYPE_CHECKING:
    from m2po_cli.eval.data import BenchPlan


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    return [k for k in (2**i for i in range(n.bit_length())) if k < n] + [n]


def summarize_benchmark(plan: BenchPlan) -> dict[str, Any]:
    """Scores of one benchmark from its graded samples (the first `num_samples` of each problem)."""
    n = plan.num_samples
    skipped = set(plan.skipped)
    rows = [[plan.records[(p.id, i)] for i in range(n)] for p in plan.problems if p.id not in skipped]
    summary: dict[str, Any] = {
        "title": plan.spec.title,
        "problems": len(plan.problems),
        "evaluated": len(rows),
        "skipped": len(plan.skipped),
        "clamped": plan.clamped,
        "samples": n,
        "avg@n": None,
        "pass@k": {},
        "mean_tokens": None,
        "truncated": None,
        "samples_file": plan.cache.name,
    }
    if rows:
        corrects = [sum(r["correct"] for r in row) for row in rows]
        flat = [r for row in rows for r in row]
        summary["avg@n"] = fmean(c / n for c in corrects)
        summary["pass@k"] = {str(k): fmean(pass_at_k(n, c, k) for c in corrects) for k in pass_ks(n)}
        summary["mean_tokens"] = fmean(r["tokens"] for r in flat)
        summary["truncated"] = fmean(not r["finished"] for r in flat)
    return summary


def summarize_target(info: dict[str, Any], benchmarks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    scored = {name: b["avg@n"] for name, b in benchmarks.items() if b["avg@n"] is not None}
    return {
        **info,
        "average": fmean(scored.values()) if scored else None,
        "average_over": list(scored),
        "benchmarks": benchmarks,
    }


# --- tables --------------------------------------------------------------------------------------


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _columns(summaries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    first = summaries[0]["benchmarks"]
    return [(name, b["title"]) for name, b in first.items()]


def _notes(summaries: list[dict[str, Any]], limit: int | None) -> list[str]:
    notes = [f"first {limit} problems of each benchmark only (--limit)"] if limit else []
    for s in summaries:
        if s["average"] is not None and len(s["average_over"]) < len(s["benchmarks"]):
            notes.append(f"{s['label']} Avg.: over {', '.join(s['average_over'])} only")
        for name, b in s["benchmarks"].items():
            if b["skipped"]:
                notes.append(
                    f"{s['label']} {name}: {b['skipped']} of {b['problems']} prompts too long, skipped"
                )
            if b["clamped"]:
                notes.append(
                    f"{s['label']} {name}: {b['clamped']} prompts with max_new_tokens cut to fit the context"
                )
    return notes


def rich_table(summaries: list[dict[str, Any]], limit: int | None) -> Table:
    """Checkpoints as rows, benchmarks as columns (avg@n, %), and Avg. last, as in Table 1."""
    columns = _columns(summaries)
    notes = _notes(summaries, limit)
    table = Table(title="avg@n (%)", caption="\n".join(notes) or None, caption_justify="left")
    table.add_column("checkpoint")
    for _, title in columns:
        table.add_column(title, justify="right")
    table.add_column("Avg.", justify="right", style="bold")
    for s in summaries:
        cells = [_cell(s["benchmarks"][name]["avg@n"]) for name, _ in columns]
        table.add_row(s["label"], *cells, _cell(s["average"]))
    return table


def markdown_table(summaries: list[dict[str, Any]], limit: int | None) -> str:
    columns = _columns(summaries)
    lines = [
        "| checkpoint | " + " | ".join(title for _, title in columns) + " | Avg. |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for s in summaries:
        cells = [_cell(s["benchmarks"][name]["avg@n"]) for name, _ in columns]
        lines.append(f"| {s['label']} | " + " | ".join(cells) + f" | {_cell(s['average'])} |")
    notes = _notes(summaries, limit)
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"
