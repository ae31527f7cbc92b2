"""The inspection wing's commands: `m2po inspect ratios` (find a run directory, read what it
recorded, show it) and `m2po compare` (runs side by side). Never imports vLLM or builds a model.

A run directory is one that `m2po train` wrote (`m2po_cli.run_dir`). The default is the run under
`./runs` whose metrics changed last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from m2po_cli import run_dir
from m2po_cli.config.loss import LossConfig
from m2po_cli.errors import UserError


def find_run(run: str | None, runs: Path = Path("runs")) -> Path:
    """The given run directory, or the newest one under `runs`. Raises RunDirError."""
    if run is not None:
        return run_dir.require(Path(run))
    try:
        return run_dir.newest(runs)
    except run_dir.RunDirError as e:
        raise run_dir.RunDirError(f"{e}; name one: m2po inspect ratios RUN_DIR") from None


def parse_steps(text: str | None) -> range | None:
    """`A:B` -> range(A, B); either end may be left out. Raises UserError."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start, stop = int(lo) if lo else 0, int(hi) if hi else sys.maxsize
    except ValueError:
        raise UserError(f"--steps: expected A:B, e.g. 100:200 or 100: (got {text!r})") from None
    if start < 0 or stop <= start:
        raise UserError(f"--steps: need 0 <= A < B (got {text!r})")
    return range(start, stop)


def run_loss(run: Path) -> tuple[LossConfig, str, int | None]:
    """The run's `[loss]` table, where its behaviour logprobs came from (`engine` or `learner`), and
    the rows of its rollout batches if it replayed rows (`[reuse] mode = "replay"`), else None."""
    recipe = run_dir.read_recipe(run)
    fresh_rows = recipe.rollout.prompts_per_step * recipe.rollout.n if recipe.reuse.mode == "replay" else None
    return recipe.loss, recipe.algorithm.behaviour_logprobs, fresh_rows


def ratios(run: str | None, steps: str | None, as_json: bool, plot_dir: str | None) -> None:
    """`m2po inspect ratios`: tables (or JSON) on stdout, PNG figures into `plot_dir`."""
    import torch

    from m2po_cli.inspection.ratios import analyse, rule_name
    from m2po_cli.inspection.report import show
    from m2po_cli.record import load_records

    # One update's tensors are small: more threads cost more than they give, all the more next to a
    # training run on the same machine (5x the CPU time with two threads on a busy 2-core machine).
    torch.set_num_threads(1)
    run = find_run(run)
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


def compare_runs(run_dirs: tuple[str, ...], as_json: bool, plot_dir: str | None, x: str = "updates") -> None:
    """`m2po compare`: tables (or JSON) on stdout, PNG figures against `x` into `plot_dir`."""
    from rich.console import Console

    from m2po_cli.inspection.compare import SPENT, CompareError, compare, read_runs, spent
    from m2po_cli.inspection.compare_plots import write_figures
    from m2po_cli.inspection.compare_report import arm_table, curve_table, run_table
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
