"""The figures of `m2po inspect ratios --plot DIR` (matplotlib, drawn off-screen into PNG files).

log_ratio_by_staleness.png   histogram of log r, one curve per staleness bucket
rules_over_training.png      share of tokens each rule clips or masks, per recorded step
entropy_vs_log_ratio.png     token entropy against |log r|, tokens M2PO masks or the PPO clip clips marked
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from m2po_cli.inspection.ratios import staleness_buckets, tokens_of  # noqa: E402
from m2po_cli.record import Records  # noqa: E402

STYLE = {
    "figure.dpi": 110,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "font.size": 9,
}


def write_plots(report: dict, acted: dict, records: Records, behaviour: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tokens = tokens_of(records, behaviour)
    with plt.rc_context(STYLE):
        return [
            _save(_histogram(tokens), out / "log_ratio_by_staleness.png"),
            _save(_rules_over_training(report), out / "rules_over_training.png"),
            _save(_entropy(tokens, acted), out / "entropy_vs_log_ratio.png"),
        ]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _histogram(tokens):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    log_ratio = tokens.log_ratio_N.double()
    span = max(float(log_ratio.abs().max()), 1e-3)
    edges = torch.linspace(-span, span, 61).numpy()
    bucket_N, names = staleness_buckets(tokens.staleness_N)
    colours = plt.cm.viridis(torch.linspace(0.0, 0.85, len(names)).numpy())
    ax.axvspan(math.log(0.8), math.log(1.2), color="0.92", zorder=0, label="PPO clip range, eps 0.2")
    for i, (name, colour) in enumerate(zip(names, colours, strict=True)):
        values = log_ratio[bucket_N == i].numpy()
        weights = torch.full((len(values),), 1 / max(len(values), 1)).numpy()
        ax.hist(
            values,
            bins=edges,
            weights=weights,
            histtype="step",
            lw=1.6,
            color=colour,
            label=f"staleness {name} ({len(values)} tokens)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("log r = log pi_current - log pi_behaviour")
    ax.set_ylabel("share of the tokens at that staleness")
    ax.set_title("Importance ratios by staleness", loc="left")
    ax.legend(frameon=False, fontsize=8)
    return fig


FAMILY_COLOURS = {
    "grpo": plt.cm.Oranges,
    "m2po": plt.cm.Blues,
    "m2po_cap": plt.cm.Greens,
    "gspo": plt.cm.Greys,
}


def _rules_over_training(report: dict):
    fig, ax = plt.subplots(figsize=(8.6, 3.8))
    families = [rule["config"]["type"] for rule in report["rules"]]
    for rule, family in zip(report["rules"], families, strict=True):
        same = [i for i, f in enumerate(families) if f == family]
        shade = 0.45 + 0.5 * same.index(report["rules"].index(rule)) / max(len(same), 1)
        steps = sorted({u["step"] for u in rule["per_update"]})
        share = [100 * _share(rule["per_update"], step) for step in steps]
        ax.plot(
            steps,
            share,
            "-" if family.startswith("m2po") else "--",
            color=FAMILY_COLOURS[family](shade),
            lw=2.6 if rule["run_loss"] else 1.3,
            marker="o",
            ms=3,
            label=rule["rule"] + (" (this run)" if rule["run_loss"] else ""),
        )
    ax.set_yscale("symlog", linthresh=0.01, linscale=0.5)
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("% of recorded tokens clipped or masked")
    ax.set_title("What each rule does to the recorded tokens, step by step", loc="left")
    ax.legend(frameon=False, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _share(per_update: list[dict], step: int) -> float:
    at = [u for u in per_update if u["step"] == step]
    return sum(u["acted"] for u in at) / max(sum(u["num_tokens"] for u in at), 1)


MAX_POINTS = 50_000  # grey background tokens drawn at most; the marked ones are always all drawn


def _entropy(tokens, acted: dict):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    floor = 1e-6
    x_N = tokens.log_ratio_N.double().abs().clamp(min=floor)
    y_N = tokens.entropy_N.double()
    shown = torch.randperm(len(x_N), generator=torch.Generator().manual_seed(0))[:MAX_POINTS]
    ax.scatter(
        x_N[shown].numpy(),
        y_N[shown].numpy(),
        s=4,
        alpha=0.3,
        color="0.5",
        lw=0,
        rasterized=True,
        label="recorded tokens",
    )
    marked = [
        ("grpo clip 0.2", "tab:orange", "clipped by PPO, eps 0.2"),
        ("m2po tau 0.04", "tab:blue", "masked by M2PO, tau 0.04"),
    ]
    for rule, colour, label in marked:
        acted_N = acted[rule]
        ax.scatter(
            x_N[acted_N].numpy(),
            y_N[acted_N].numpy(),
            s=14,
            color=colour,
            lw=0,
            alpha=0.8,
            label=f"{label} ({int(acted_N.sum())})",
        )
    edges = torch.logspace(math.log10(floor), math.log10(float(x_N.max()) * 1.01), 25, dtype=torch.float64)
    bin_N = torch.bucketize(x_N, edges)
    centres, means = [], []
    for b in bin_N.unique().tolist():
        if int((bin_N == b).sum()) >= 20:
            centres.append(float(x_N[bin_N == b].median()))
            means.append(float(y_N[bin_N == b].mean()))
    ax.plot(centres, means, color="black", lw=1.5, label="mean entropy, binned by |log r|")
    ax.set_xscale("log")
    ax.set_xlabel(f"|log r| (values below {floor:g} drawn at {floor:g})")
    ax.set_ylabel("entropy at the token (nats)")
    ax.set_title("Token entropy against the size of the ratio", loc="left")
    ax.legend(frameon=False, fontsize=8, loc="best", markerscale=1.5)
    return fig
