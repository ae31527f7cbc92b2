"""The SmolLM2 CPU recipe: where a step's time goes, against the engine's raw generation time.

Two phases, one after the other, in fresh processes (so neither shares the CPU with the other):
1. engine alone: the rollout engine of `recipes/smollm2-135m-cpu.toml` (same model, dtype, sampling
   settings, KV cache and seeds) generates the rollout batches of the run's steps from the initial
   weights; only `generate` is timed. This is the baseline: the least a step can cost.
2. the run: `m2po train` on the same recipe (`--steps` steps, default 4) into a temporary directory;
   its `metrics.jsonl` gives each phase's seconds (`time/*`).
Prints, over the steady-state steps (all but the first, whose first forward/backward warms oneDNN up),
the mean seconds of each phase and its ratio to the engine's raw generation time of the same
prompts. With `--full` the whole recipe runs and the reward of the first and the last fifth of its
steps is printed too; it exits 1 unless the last fifth beats the first by `--margin`.

    .venv/bin/python bench/bench_smollm2.py [--steps 4] [--full] [--margin 0.05] [--set KEY=VALUE ...]

The machine's load average is printed before and after: on a shared machine every phase slows down
alike, so compare ratios, not seconds.

What a step of this recipe costs: 4 prompts x 8 samples x (~55 prompt + ~15 response tokens), about
2.2k tokens through a 134.5M-parameter model (~0.27 GFLOP per token forward) in each of the
learner's passes: the update (forward + backward, ~3 forwards), M2PO's global mask (a no-grad
forward first, or a correction after the training forwards, whichever `learner.update` judges
cheaper) and a 4-row sample at the behaviour version; about 2-2.4 TFLOP a step, so a 2-core AVX2
CPU (~50-100 GFLOP/s in fp32) spends most of a step in the learner. Generation is ~500 tokens a step; one 0.54 GB fp32
weight push. The prompt is ~75% of the rows' tokens; the learner computes it once per group
(`train.share_prompts`, on here by `auto`), ~850 tokens a pass instead of ~2.8k padded ones. At the
8B recipe's sizes `auto` leaves rows unpacked (`m2po_cli/learner/shared_prompts.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m2po_cli.cli import idle_threads_sleep

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-cpu.toml"
PHASES = ["generate", "grade", "score", "update", "weight_sync", "rollout", "train", "step"]


def engine_alone(recipe_path: str, overrides: list[str], steps: int) -> list[float]:
    """Seconds of `generate` for the rollout batch made at each step 0..steps-1 (initial weights)."""
    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.device import resolve_dtype
    from m2po_cli.models import load_tokenizer, resolve_model
    from m2po_cli.rollout.engine import VLLMEngine
    from m2po_cli.rollout.settings import request_seed

    recipe = load_recipe(recipe_path, overrides)
    model_dir = resolve_model(recipe.model.path)
    prompts = PromptBatches(
        load_problems(recipe.data), load_tokenizer(model_dir), recipe.data, recipe.rollout.prompts_per_step
    )
    engine = VLLMEngine(model_dir, recipe.rollout, resolve_dtype(recipe.model.dtype), recipe.max_model_len)
    try:
        k = recipe.queue_batches
        times = []
        for index in range(-k, steps):  # the K warm-up batches come first, as in the run
            batch = [p.token_ids for p in next(prompts)]
            t0 = time.perf_counter()
            engine.generate(batch, [request_seed(recipe.run.seed, index, i) for i in range(len(batch))])
            if index >= 0:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        engine.close()


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    """The engine-alone phase in a child process (this script again, `--engine-only`); its JSON."""
    steps = min(args.steps, args.raw_steps)
    cmd = [sys.executable, __file__, "--engine-only", "--steps", str(steps), "--recipe", args.recipe]
    cmd += [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if proc.returncode:
        sys.exit(f"the engine-alone phase failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train(args: argparse.Namespace, overrides: list[str], out_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "m2po_cli", "train", args.recipe, "--set", f'run.output_dir="{out_dir}"']
    cmd += ["--set", 'run.name="bench"', "--set", 'logging.console="plain"']
    cmd += [a for o in overrides for a in ("--set", o)]
    subprocess.run(cmd, check=True, env=os.environ)
    lines = (out_dir / "bench" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def report(metrics: list[dict], raw_S: list[float], updates_per_step: int) -> None:
    steady = metrics[1:] or metrics
    raw = statistics.mean(raw_S[1:] or raw_S)
    print(f"steps {len(metrics)}; steady state = steps {steady[0]['step']}..{steady[-1]['step']}")
    print(f"{'phase':<24}{'s/step':>9}{'x raw gen':>11}")
    print(f"{'engine alone: generate':<24}{raw:9.2f}{1.0:11.2f}")
    for phase in PHASES:
        key = f"time/{phase}"
        if key not in steady[0]:
            continue
        per_step = statistics.mean(m[key] for m in steady)
        if phase in ("update", "weight_sync"):  # logged as the mean over the step's updates
            per_step *= updates_per_step
        print(f"{phase:<24}{per_step:9.2f}{per_step / raw:11.2f}")
    tokens = statistics.mean(m["rollout/response_tokens_mean"] for m in steady)
    truncated = statistics.mean(m["rollout/truncated_frac"] for m in steady)
    print(f"response tokens, mean {tokens:.1f}; truncated {truncated:.2f}")


def fifths(metrics: list[dict]) -> tuple[float, float, int]:
    rewards = [m["rollout/reward_mean"] for m in metrics]
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k, k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--steps", type=int, default=4, help="steps to run (ignored with --full)")
    ap.add_argument(
        "--raw-steps", type=int, default=4, help="steps whose batches the engine alone generates (at most)"
    )
    ap.add_argument("--full", action="store_true", help="run the whole recipe and compare reward fifths")
    ap.add_argument("--margin", type=float, default=0.05, help="least rise of the reward, with --full")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    idle_threads_sleep()  # as `m2po train` does; both phases run with the same OpenMP policy
    if args.engine_only:
        print(json.dumps({"generate_S": engine_alone(args.recipe, args.overrides, args.steps)}))
        return 0
    from m2po_cli.config import load_recipe

    overrides = list(args.overrides) + ([] if args.full else [f"run.steps={args.steps}"])
    recipe = load_recipe(args.recipe, overrides)
    args.steps = recipe.run.steps
    print(f"{load()} (start)")
    t0 = time.perf_counter()
    raw_S = run(args, overrides)["generate_S"]
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="m2po-bench-") as tmp:
        metrics = train(args, overrides, Path(tmp))
    t2 = time.perf_counter()
    print(f"{load()} (end); engine alone {t1 - t0:.0f} s in all, the run {t2 - t1:.0f} s in all")
    report(metrics, raw_S, recipe.updates_per_step)
    if not args.full:
        return 0
    first, last, k = fifths(metrics)
    print(
        f"reward, first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({last - first:+.3f}; "
        f"margin asked {args.margin:+.3f}) in {t2 - t1:.0f} s"
    )
    return 0 if last - first >= args.margin else 1


if __name__ == "__main__":
    sys.exit(main())
