"""Train a recipe twice with the same seed and say where the two runs part, if they do.

    .venv/bin/python scripts/determinism.py recipes/quickstart.toml --steps 20 [--set K=V ...] [--busy]
    .venv/bin/python scripts/determinism.py --compare RUN_A RUN_B

Each run trains `--steps` steps in a folder of its own (`--out`, temporary by default), one after
the other; `--busy` keeps the machine's other cores busy during the second one. Then their
`metrics.jsonl` are compared value by value, step by step, leaving out what measures the machine
rather than the run (keys under `time/`, `perf/` and `mem/`), and so are their exported weights
(`export/*.safetensors`, byte for byte) when both have them. Prints `identical` with the steps and
values compared and one hash of each run's compared values, or the first step and key where the
runs part, with both values. Exits 0 when identical, 1 when they part, 2 when a run fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE_KEYS = ("time/", "perf/", "mem/")  # how fast and how big, not what was computed


def compared(run_dir: Path) -> list[dict]:
    """Each step's metrics without the machine's measurements."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(MACHINE_KEYS)}
        for line in lines
        if line.strip()
    ]


def digest(steps: list[dict]) -> str:
    return hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two runs' metrics first differ (step order, then key order), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        for key in sorted(x.keys() | y.keys()):
            if x.get(key) != y.get(key):
                return f"step {x.get('step', i)}, {key}: {x.get(key)!r} vs {y.get(key)!r}"
    if len(a) != len(b):
        return f"one run logged {len(a)} steps, the other {len(b)}"
    return None


def exported(run_dir: Path) -> bytes | None:
    """The run's exported weights (and a LoRA run's adapter), every file in name order; None without."""
    files = sorted((run_dir / "export").glob("*.safetensors")) + sorted(
        (run_dir / "adapter").glob("*.safetensors")
    )
    return b"".join(f.read_bytes() for f in files) if files else None


def report(a_dir: Path, b_dir: Path) -> int:
    a, b = compared(a_dir), compared(b_dir)
    where = first_difference(a, b)
    weights_a, weights_b = exported(a_dir), exported(b_dir)
    if where is None and weights_a != weights_b:
        where = "the exported weights" if weights_a and weights_b else "the export (one run has none)"
    if where is None:
        values = sum(len(step) for step in a)
        exports = ", the same exported weights" if weights_a else ""
        print(f"identical: {len(a)} steps, {values} values{exports}; sha256 {digest(a)} = {digest(b)}")
        return 0
    print(f"the runs part at {where} (sha256 {digest(a)} vs {digest(b)})")
    return 1


def spin() -> None:
    x = 0
    while True:
        x = (x * 1_103_515_245 + 12_345) % 2**31


def train(recipe: Path, out: Path, name: str, steps: int, overrides: list[str]) -> int:
    sets = [*overrides, f"run.steps={steps}", f'run.name="{name}"', f'run.output_dir="{out}"']
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with open(out / f"{name}.log", "w") as log:
        cmd = [
            sys.executable,
            "-m",
            "m2po_cli",
            "train",
            str(recipe),
            *[a for s in sets for a in ("--set", s)],
        ]
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        print(f"determinism: run {name} failed (exit {done.returncode}); see {out / (name + '.log')}")
    return done.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", type=Path, nargs="?")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, default=None, help="where the two runs go (default: temporary)")
    ap.add_argument("--busy", action="store_true", help="keep the other cores busy during the second run")
    ap.add_argument(
        "--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help="compare two run folders"
    )
    args = ap.parse_args()
    if args.compare:
        return report(*args.compare)
    if args.recipe is None:
        ap.error("give a recipe, or --compare RUN_A RUN_B")
    with tempfile.TemporaryDirectory(prefix="m2po-determinism-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        if train(args.recipe, out, "run-a", args.steps, args.overrides):
            return 2
        cores = max(1, (os.cpu_count() or 2) - 1) if args.busy else 0
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(cores)]
        for p in spinners:
            p.start()
        try:
            code = train(args.recipe, out, "run-b", args.steps, args.overrides)
        finally:
            for p in spinners:
                p.terminate()
        return 2 if code else report(out / "run-a", out / "run-b")


if __name__ == "__main__":
    sys.exit(main())
