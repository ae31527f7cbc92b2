"""Run several recipes (the arms of a comparison) for several seeds, one run at a time, then compare.

    .venv/bin/python scripts/sweep.py recipes/reproduce/*.toml --seeds 3 --out runs/sweep [--set K=V ...]

Run `<arm>-seed<S>` of recipe `<arm>.toml` trains with `run.seed = S` under `--out`; `--set`
overrides go to every run. `--grid KEY=V1,V2,...` makes an arm of every recipe at every value,
`<arm>-<leaf><value>` (`--grid staleness.s=16,256`: `m2po-s16`, `m2po-s256`); `--seeds-for
PATTERN=N` gives the arms whose name matches the shell pattern N seeds instead of `--seeds`
(`--seeds 1 --seeds-for '*-s256=3'`), and `--exclude PATTERN` leaves out the arms it matches
(`--exclude 'm2po-s0'`). Runs go seed by seed, so a sweep cut short has every arm at
the same seeds; `--dry-run` lists them and their overrides without running anything. The sweep is
resumable: a run whose `metrics.jsonl` already holds all its steps is skipped, and an unfinished one
resumes from its last checkpoint (`m2po train` does that; give the recipes a `checkpoint.every`). It
ends with `m2po compare` over every run of the sweep: the table on the console and, under
`--out`/figures, the figures (`--x tokens --x seconds`: also against the generated tokens and the
wall seconds, for arms that spend them at different rates; arms at several `staleness.s`: the
staleness curve). Each run's console goes to `<run>.log` beside it. Exits with the first failing
run's exit code; bad arguments exit 2 with one line.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from m2po_cli.config import ConfigError, load_recipe

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


class Arm(NamedTuple):
    name: str
    recipe: Path
    sets: list[str]  # the arm's overrides (its grid values)
    seeds: int


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`KEY=V1,V2,...` each, to (KEY, [V1, V2, ...]); ValueError naming the bad one."""
    grid = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key.strip() or not all(v.strip() for v in values.split(",")):
            raise ValueError(f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. staleness.s=16,64,256)")
        grid.append((key.strip(), [v.strip() for v in values.split(",")]))
    return grid


def parse_seeds_for(specs: list[str]) -> list[tuple[str, int]]:
    """`PATTERN=N` each, to (PATTERN, N); ValueError naming the bad one."""
    out = []
    for spec in specs:
        pattern, sep, n = spec.rpartition("=")
        if not sep or not pattern or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--seeds-for {spec!r}: expected PATTERN=N with N >= 1 (e.g. '*-s256=3')")
        out.append((pattern, int(n)))
    return out


def plan(
    recipes: list[Path],
    grid: list[tuple[str, list[str]]],
    seeds: int,
    seeds_for: list[tuple[str, int]],
    exclude: list[str] = (),
) -> list[Arm]:
    """Every recipe at every point of the grid, but the arms an `exclude` pattern matches, each with
    its number of seeds (the last matching `seeds_for` pattern, else `seeds`). ValueError if two arms
    share a name or a pattern matches no arm."""
    arms = []
    excluded = set()
    for recipe in recipes:
        for point in itertools.product(*[[(key, v) for v in values] for key, values in grid]):
            name = "-".join([recipe.stem, *[f"{key.rsplit('.', 1)[-1]}{v}" for key, v in point]])
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude):
                excluded.add(name)
                continue
            n = next((k for pattern, k in reversed(seeds_for) if fnmatch.fnmatchcase(name, pattern)), seeds)
            arms.append(Arm(name, recipe, [f"{key}={v}" for key, v in point], n))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"two arms share a name: {sorted({n for n in names if names.count(n) > 1})}")
    unmatched = [p for p, _ in seeds_for if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"--seeds-for {unmatched[0]!r} matches no arm (the arms: {', '.join(names)})")
    unmatched = [p for p in exclude if not any(fnmatch.fnmatchcase(n, p) for n in excluded)]
    if unmatched:
        raise ValueError(f"--exclude {unmatched[0]!r} matches no arm (the arms: {', '.join(names)})")
    if not arms:
        raise ValueError("--exclude leaves no arm")
    return arms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm (default 3)")
    ap.add_argument("--out", type=Path, default=Path("runs/sweep"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", help="an arm per value")
    ap.add_argument(
        "--seeds-for", action="append", default=[], metavar="PATTERN=N", help="N seeds for these arms"
    )
    ap.add_argument(
        "--exclude", action="append", default=[], metavar="PATTERN", help="leave out the arms it matches"
    )
    ap.add_argument("--dry-run", action="store_true", help="list the runs and their overrides, run nothing")
    ap.add_argument(
        "--x",
        action="append",
        choices=["updates", "tokens", "seconds"],
        help="the figures' x-axis (m2po compare --x); repeat for several (default: updates)",
    )
    args = ap.parse_args()
    args.x = args.x or ["updates"]
    try:
        arms = plan(
            args.recipes, parse_grid(args.grid), args.seeds, parse_seeds_for(args.seeds_for), args.exclude
        )
        steps = {
            arm.name: planned_steps(arm.recipe, [*args.overrides, *arm.sets]) for arm in arms
        }  # every recipe checked first
    except (ValueError, ConfigError) as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    m2po = [sys.executable, "-m", "m2po_cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = []
    t_sweep = time.perf_counter()
    for seed in range(
        max(a.seeds for a in arms)
    ):  # seed by seed, so a cut sweep has every arm at the same seeds
        for arm in arms:
            if seed >= arm.seeds:
                continue
            name = f"{arm.name}-seed{seed}"
            sets = [
                *args.overrides,
                *arm.sets,
                f"run.seed={seed}",
                f'run.name="{name}"',
                f'run.output_dir="{args.out}"',
            ]
            run_dir = args.out / name
            runs.append(run_dir)
            if args.dry_run:
                print(f"{name}: {arm.recipe} " + " ".join(f"--set {s}" for s in sets[:-3]), flush=True)
                continue
            if finished(run_dir, steps[arm.name]):
                print(f"{name}: done already", flush=True)
                continue
            args.out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            with open(args.out / f"{name}.log", "a") as log:
                cmd = [*m2po, "train", str(arm.recipe), *[a for s in sets for a in ("--set", s)]]
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())
            if done.returncode:
                print(
                    f"{name}: failed (exit {done.returncode}); see {args.out / (name + '.log')}",
                    file=sys.stderr,
                )
                return done.returncode
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.dry_run:
        print(f"sweep: {len(runs)} runs", flush=True)
        return 0
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
