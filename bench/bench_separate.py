"""Separate mode against colocated mode: same recipe, same number of optimizer updates, same seeds.

Runs `m2po train` in fresh processes on the quickstart task: colocated (fixed staleness s) and
separate (bounded staleness, max_staleness = s), once per seed, alternating modes. Prints for each
run the whole wall time (engine start included), the steady-state time per step (steps after the
first), samples per second, the learner's idle fraction (colocated: the share of each step spent
generating; separate: the share spent waiting for rollouts) and the mean reward of the first and the
last fifth of the steps; then, over the seeds, each mode's mean and the separate / colocated ratios.

Both modes start from the same policy, so the last fifth's reward is what says which learned more.
The first fifth is not a common baseline: separate mode trains on fresher samples from the first
step (staleness 0 to max_staleness instead of exactly s), so its early reward is already higher and
"last fifth minus first fifth" understates what it learned. One run's reward varies by a few
hundredths from seed to seed (and a separate-mode run is not repeatable: timing decides which
version samples what), so compare means over seeds.

On a CPU both sides share the same cores unless pinned, so running them at once saves only what
one side leaves idle of the machine; bench/bench_overlap.py pins each side to a core of its own and
measures the overlap itself. With engines on their own GPUs a step costs about max(generate, train)
instead of generate + train.

Weight traffic at the 8B recipe's size (8.2e9 parameters in bf16): 16.4 GB written to shared memory
per sync, at most one full parameter (the 151,936 x 4,096 embedding, 1.2 GB) held beyond a rank's
shard.

    .venv/bin/python bench/bench_separate.py [--steps 20] [--prompts 16] [--staleness 4] [--seeds 1] [--first-seed 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    recipe = ROOT / "recipes" / ("quickstart-separate.toml" if mode == "separate" else "quickstart.toml")
    sets = [
        f'run.output_dir="{out}"',
        f'run.name="{mode}-{seed}"',
        f"run.seed={seed}",
        f"run.steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        "checkpoint.every=0",
        "checkpoint.export_hf=false",
        'logging.console="plain"',
        f"staleness.max_staleness={args.staleness}"
        if mode == "separate"
        else f"staleness.s={args.staleness}",
    ]
    if mode == "separate":  # the engine synced after every update: its staleness is at most s
        sets.append("rollout.sync_every=1")
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(recipe), *(a for s in sets for a in ("--set", s))]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{mode} run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    wall = time.perf_counter() - t0
    every = [json.loads(line) for line in (out / f"{mode}-{seed}" / "metrics.jsonl").read_text().splitlines()]
    fifth = max(1, len(every) // 5)
    rewards = [m["rollout/reward_mean"] for m in every]
    steps = every[1:]
    step_s = sum(m["time/step"] for m in steps)
    if mode == "separate":
        idle = sum(m["perf/learner_idle_frac"] * m["time/step"] for m in steps) / step_s
    else:
        idle = sum(m["time/rollout"] for m in steps) / step_s
    samples = len(steps) * args.prompts * 8
    return {
        "wall_s": wall,
        "step_s": step_s / len(steps),
        "samples_per_s": samples / step_s,
        "learner_idle": idle,
        "reward_first": sum(rewards[:fifth]) / fifth,
        "reward_last": sum(rewards[-fifth:]) / fifth,
    }


HEADER = (
    f"{'':14s} {'wall s':>8s} {'s/step':>8s} {'samples/s':>10s} {'learner idle':>13s} "
    f"{'reward first fifth':>19s} {'last fifth':>11s}"
)


def line(label: str, r: dict[str, float]) -> str:
    return (
        f"{label:14s} {r['wall_s']:8.1f} {r['step_s']:8.2f} {r['samples_per_s']:10.1f} "
        f"{100 * r['learner_idle']:12.0f}% {r['reward_first']:19.3f} {r['reward_last']:11.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument(
        "--seeds", type=int, default=1, help="runs per mode (seeds first-seed, first-seed + 1, ...)"
    )
    p.add_argument("--first-seed", type=int, default=0)
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"colocated": [], "separate": []}
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="m2po-bench-separate-") as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for mode, results in runs.items():
                results.append(run(mode, seed, args, Path(tmp)))
                print(line(f"{mode} {seed}", results[-1]), flush=True)
    mean = {mode: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"mean over {args.seeds} seed(s):")
    for mode, r in mean.items():
        print(line(mode, r))
    gaps = [
        s["reward_last"] - c["reward_last"] for s, c in zip(runs["separate"], runs["colocated"], strict=True)
    ]
    if len(gaps) > 1:
        se = statistics.stdev(gaps) / len(gaps) ** 0.5
        print(
            f"last fifth's reward, separate - colocated, seed by seed: "
            f"{' '.join(f'{g:+.3f}' for g in gaps)}; mean {statistics.mean(gaps):+.3f} +- {se:.3f} (standard error)"
        )
    c, s = mean["colocated"], mean["separate"]
    print(
        f"separate / colocated: wall {s['wall_s'] / c['wall_s']:.2f}x, time per step "
        f"{s['step_s'] / c['step_s']:.2f}x, samples/s {s['samples_per_s'] / c['samples_per_s']:.2f}x, "
        f"reward of the last fifth {s['reward_last'] - c['reward_last']:+.3f} "
        f"({args.steps} steps, {args.prompts} prompts x 8 samples, staleness {args.staleness})"
    )


if __name__ == "__main__":
    main()
