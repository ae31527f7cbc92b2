"""Time `m2po inspect ratios` as a whole process, against `python -c "import torch"` in the same run.

Without RUN_DIR it writes a synthetic run directory holding what the 8B recipe
(recipes/qwen3-8b-s256.toml, 1,200 steps of 4 updates) records with the default `[inspect]` budget,
through the trainer's own writer: every 50th step, 4,096 response tokens per update, so 24 files of
4 x 4,096 tokens (393,216 tokens, 16 bytes each: 6.3 MB). Its log r is heavy-tailed (normal plus a
Student-t tail, the "stale" batch of bench_loss.py), staleness ramps to 256 as in a run's warm-up.
Prints the medians of interleaved repeats, wall-clock and CPU time (the latter holds still on a shared,
busy machine), and their ratios to the baseline: the cost of importing torch, which every torch
command pays.

    .venv/bin/python bench/bench_inspect.py [RUN_DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from m2po_cli.config import InspectConfig, load_recipe
from m2po_cli.config.tables import to_toml
from m2po_cli.record import Recorder, Sample, record_files

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, UPDATES, TOKENS, RESPONSE = 1200, 50, 4, 4096, 1024


def synthetic_run(run_dir: Path) -> Path:
    """The records of an 8B-recipe run at the default budget, written by the trainer's Recorder."""
    recipe = load_recipe(ROOT / "recipes" / "qwen3-8b-s256.toml")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(recipe))
    recorder = Recorder(run_dir, InspectConfig(every=EVERY, tokens=TOKENS), seed=0, rank=0, world=1)
    g = torch.Generator().manual_seed(0)
    for step in range(0, STEPS, EVERY):
        for u in range(UPDATES):
            update = step * UPDATES + u
            staleness = min(update, 256)
            recorder.pick(step, update, [0], [TOKENS])  # as the trainer does before each update
            recorder.add(_sample(g, update, staleness), {"loss/clip_frac": 0.0, "loss/num_tokens": 0.0})
        recorder.write(step)
    return run_dir


def _sample(g: torch.Generator, update: int, staleness: int) -> Sample:
    rows, n = TOKENS // RESPONSE, TOKENS
    behaviour = -torch.rand(n, generator=g) * 3
    scale = 0.02 + 0.1 * staleness / 256
    tail = torch.randn(n, generator=g) / torch.randn(n, generator=g).abs().clamp(min=0.05)
    drift = scale * torch.randn(n, generator=g) + 0.3 * scale * tail
    mismatch = 1e-3 * torch.randn(n, generator=g)
    return Sample(
        behaviour_logprobs_N=behaviour,
        learner_logprobs_N=behaviour + mismatch,
        logprobs_N=behaviour + mismatch + drift,
        entropy_N=torch.rand(n, generator=g) * 2,
        lengths_R=torch.full((rows,), RESPONSE),
        advantages_R=torch.randn(rows, generator=g),
        staleness_N=torch.full((n,), staleness),
        turn_N=torch.zeros(n, dtype=torch.long),
        update_R=torch.full((rows,), update),
        row_R=torch.arange(rows),
        scored_R=torch.ones(rows, dtype=torch.bool),
    )


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall-clock and CPU (user + system) seconds of one whole process."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.perf_counter() - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    run = Path(args.run_dir) if args.run_dir else synthetic_run(Path(tempfile.mkdtemp()) / "synthetic-8b")
    files = record_files(run)
    size = sum(p.stat().st_size for p in files)
    print(f"{run.name}: {len(files)} record files, {size / 1e6:.1f} MB")
    plots = Path(tempfile.mkdtemp())
    commands = {
        "import torch": [sys.executable, "-c", "import torch"],
        "inspect ratios": [sys.executable, "-m", "m2po_cli", "inspect", "ratios", str(run)],
        "inspect ratios --plot": [
            sys.executable,
            "-m",
            "m2po_cli",
            "inspect",
            "ratios",
            str(run),
            "--plot",
            str(plots),
        ],
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, cmd in commands.items():
            times[name].append(timed(cmd))
    wall = {name: statistics.median(w for w, _ in values) for name, values in times.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in times.items()}
    for name in commands:
        print(
            f"{name:24s} wall {wall[name]:6.2f} s ({wall[name] / wall['import torch']:4.1f} x import torch)"
            f"   cpu {cpu[name]:6.2f} s ({cpu[name] / cpu['import torch']:4.1f} x)"
        )


if __name__ == "__main__":
    main()
