"""Run several recipes (the arms of a comparison) for several seeds, one run at a time, then compare.

    .venv/bin/python scripts/sweep.py recipes/reproduce/*.toml --seeds 3 --out runs/sweep [--set K=V ...]

Run `<arm>-seed<S>` of recipe `<arm>.toml` trains with `run.seed = S` under `--out`; `--set`
overrides go to every run. The sweep is resumable: a run whose `metrics.jsonl` already holds all
its steps is skipped, and an unfinished one resumes from its last checkpoint (`m2po train` does
that; give the recipes a `checkpoint.every`). It ends with `m2po compare` over every run of the
sweep: the table on the console and, under `--out`/figures, the figures (`--x tokens --x seconds`:
also against the generated tokens and the wall seconds, for arms that spend them at different
rates). Each run's console goes to `<run>.log` beside it. Exits with the first failing run's exit
code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from m2po_cli.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def finished(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    return bool(lines) and json.loads(lines[-1])["step"] + 1 >= steps


def planned_steps(recipe: Path, overrides: list[str]) -> int:
    """`run.steps` of the recipe after the overrides (read the way `m2po train` reads it)."""
    return load_recipe(recipe, overrides).run.steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per recipe (default 3)")
    ap.add_argument("--out", type=Path, default=Path("runs/sweep"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--x",
        action="append",
        choices=["updates", "tokens", "seconds"],
        help="the figures' x-axis (m2po compare --x); repeat for several (default: updates)",
    )
    args = ap.parse_args()
    args.x = args.x or ["updates"]
    m2po = [sys.executable, "-m", "m2po_cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args.out.mkdir(parents=True, exist_ok=True)
    names = [p.stem for p in args.recipes]
    if len(set(names)) != len(names):
        print(
            f"sweep: two recipes share a name: {sorted(n for n in names if names.count(n) > 1)}",
            file=sys.stderr,
        )
        return 2
    runs = []
    t_sweep = time.perf_counter()
    for seed in range(args.seeds):  # seed by seed, so a cut sweep has every arm at the same seeds
        for recipe in args.recipes:
            name = f"{recipe.stem}-seed{seed}"
            sets = [*args.overrides, f"run.seed={seed}", f'run.name="{name}"', f'run.output_dir="{args.out}"']
            run_dir = args.out / name
            runs.append(run_dir)
            if finished(run_dir, planned_steps(recipe, sets)):
                print(f"{name}: done already", flush=True)
                continue
            t0 = time.perf_counter()
            with open(args.out / f"{name}.log", "a") as log:
                cmd = [*m2po, "train", str(recipe), *[a for s in sets for a in ("--set", s)]]
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())
            if done.returncode:
                print(
                    f"{name}: failed (exit {done.returncode}); see {args.out / (name + '.log')}",
                    file=sys.stderr,
                )
                return done.returncode
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"sweep: {len(runs)} runs, {time.perf_counter() - t_sweep:.0f} s", flush=True)
    compare = [*m2po, "compare", *map(str, runs), "--plot", str(args.out / "figures")]
    for x in args.x:  # the figures against the other x-axes too; the tables once
        quiet = {} if x == args.x[0] else {"stdout": subprocess.DEVNULL}
        done = subprocess.run([*compare, "--x", x], env=env, **quiet)
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
