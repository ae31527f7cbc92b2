"""What reproducibility costs: a recipe's seconds per step with this checkout against an earlier revision.

    .venv/bin/python bench/bench_determinism.py --base REV [--recipe recipes/quickstart.toml]
        [--steps 60] [--skip 10] [--repeats 2] [--set KEY=VALUE ...]

`REV` is checked out into a temporary git worktree; both arms run `m2po train` from this checkout's
venv, the base with the worktree first on `PYTHONPATH`, one after the other and alternating (base,
this, base, this, ...), so a change in the machine's load falls on both. Both train the same model
folder (the recipe's, resolved by this checkout) with the same seed for `--steps` steps. Each run's
seconds per step is the mean of `time/step` (generation, grading, scoring, the updates and the
weight push: the whole step) over the steps after the first `--skip`; prints each pair's ratio
this / base and their median, with the machine's load average before and after.

With `--base` at the revision before runs became reproducible, this measures what it costs: seeded
sampling (a generator per request in vLLM's sampler), every prompt prefilled in one engine step
(chunked prefill off on the CPU, which seeded sampling needs there) and the head's order-fixed
gradient (`index_select`, whose backward adds repeated positions in a fixed order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def seconds_per_step(code: Path, args: argparse.Namespace, model: Path, out: Path) -> float:
    """One `m2po train` run with the package found at `code`; its mean `time/step` after the skip."""
    sets = [*args.overrides, f"run.steps={args.steps}", f'model.path="{model}"']
    sets += [f'run.output_dir="{out.parent}"', f'run.name="{out.name}"', 'logging.console="plain"']
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(args.recipe.resolve())]
    cmd += [a for s in sets for a in ("--set", s)]
    with open(f"{out}.log", "w") as log:
        done = subprocess.run(
            cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": path}
        )
    if done.returncode:
        sys.exit(f"bench_determinism: the run in {out} failed (exit {done.returncode}); see {out}.log")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.mean(m["time/step"] for m in steps[args.skip :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart.toml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="first steps left out (engine and kernel warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    if args.skip >= args.steps:
        ap.error(f"--skip {args.skip} leaves none of --steps {args.steps}")

    from m2po_cli.config import load_recipe
    from m2po_cli.models import resolve_model

    model = resolve_model(load_recipe(str(args.recipe), args.overrides).model.path)
    base = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True
    )
    if base.returncode:
        ap.error(f"--base {args.base}: not a revision of {ROOT}")
    with tempfile.TemporaryDirectory(prefix="m2po-bench-determinism-") as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            print(
                f"{args.recipe.name}: {args.steps} steps a run, the first {args.skip} left out; base {base.stdout.strip()}"
            )
            print(load())
            pairs = []
            for r in range(args.repeats):
                before = seconds_per_step(worktree, args, model, Path(tmp) / f"base-{r}")
                after = seconds_per_step(ROOT, args, model, Path(tmp) / f"this-{r}")
                pairs.append((before, after))
                print(
                    f"repeat {r}: base {before:.3f} s/step, this {after:.3f} s/step, ratio {after / before:.3f}"
                )
            print(load())
            ratio = statistics.median(after / before for before, after in pairs)
            print(f"this / base seconds per step: {ratio:.3f} (median of {len(pairs)} pairs)")
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
