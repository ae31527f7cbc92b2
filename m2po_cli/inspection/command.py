"""`m2po inspect`: find a run directory, read what it recorded, show it. Never imports vLLM or builds a model.

A run directory is one that `m2po train` wrote: it holds `config.toml`. The default is the run under
`./runs` whose metrics changed last.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

from pydantic import TypeAdapter, ValidationError
from rich.console import Console

from m2po_cli.config.loss import LossConfig
from m2po_cli.record import RecordError, load_records


def find_run(run_dir: str | None, runs: Path = Path("runs")) -> Path:
    """The given run directory, or the newest one under `runs`. Raises RecordError."""
    if run_dir is not None:
        path = Path(run_dir)
        if not (path / "config.toml").is_file():
            raise RecordError(f"{path}: not a run directory (no config.toml; `m2po train` writes one)")
        return path
    candidates = [p for p in runs.glob("*") if (p / "config.toml").is_file()] if runs.is_dir() else []
    if not candidates:
        raise RecordError(f"no run directories under {runs}/; name one: m2po inspect ratios RUN_DIR")
    return max(candidates, key=_last_change)


def _last_change(run: Path) -> float:
    metrics = run / "metrics.jsonl"
    return (metrics if metrics.exists() else run / "config.toml").stat().st_mtime


def parse_steps(text: str | None) -> range | None:
    """`A:B` -> range(A, B); either end may be left out. Raises RecordError."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start, stop = int(lo) if lo else 0, int(hi) if hi else sys.maxsize
    except ValueError:
        raise RecordError(f"--steps: expected A:B, e.g. 100:200 or 100: (got {text!r})") from None
    if start < 0 or stop <= start:
        raise RecordError(f"--steps: need 0 <= A < B (got {text!r})")
    return range(start, stop)


def run_loss(run: Path) -> tuple[LossConfig, str, int | None]:
    """The run's `[loss]` table, where its behaviour logprobs came from (`engine` or `learner`), and
    the rows of its rollout batches if it replayed rows (`[reuse] mode = "replay"`), else None."""
    try:
        tree = tomllib.loads((run / "config.toml").read_text())
        loss = TypeAdapter(LossConfig).validate_python(tree.get("loss", {}))
    except (tomllib.TOMLDecodeError, ValidationError) as e:
        first = str(e).splitlines()[0]
        raise RecordError(f"{run / 'config.toml'}: not a valid run config ({first})") from None
    rollout, fresh_rows = tree.get("rollout", {}), None
    if tree.get("reuse", {}).get("mode") == "replay":
        fresh_rows = int(rollout["prompts_per_step"]) * int(rollout["n"])
    return loss, tree.get("algorithm", {}).get("behaviour_logprobs", "engine"), fresh_rows


def ratios(run_dir: str | None, steps: str | None, as_json: bool, plot_dir: str | None) -> None:
    """`m2po inspect ratios`: tables (or JSON) on stdout, PNG figures into `plot_dir`."""
    import torch

    from m2po_cli.inspection.ratios import analyse, rule_name
    from m2po_cli.inspection.report import show

    # One update's tensors are small: more threads cost more than they give, all the more next to a
    # training run on the same machine (5x the CPU time with two threads on a busy 2-core machine).
    torch.set_num_threads(1)
    run = find_run(run_dir)
    chosen = parse_steps(steps)
    loss, behaviour, fresh_rows = run_loss(run)
    records = load_records(run, chosen)
    report, acted = analyse(records, loss, behaviour, fresh_rows)
    console = Console()
    if plot_dir is not None:
        from m2po_cli.inspection.plots import write_plots

        report["plots"] = [str(p) for p in write_plots(report, acted, records, behaviour, Path(plot_dir))]
    if as_json:
        console.file.write(json.dumps(report, indent=1) + "\n")
        return
    show(report, str(run), rule_name(loss), console)
    for path in report.get("plots", []):
        console.print(f"wrote {path}")
