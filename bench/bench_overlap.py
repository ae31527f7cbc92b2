"""Does separate mode overlap generation and training? The overlap efficiency, on two CPU cores.

Separate mode is worth its staleness only if the engine and the learner work at the same time, so a
step costs max(generate, train) instead of generate + train. On a 2-core machine that can be shown
by giving each side one core of its own (one thread each): the engine (`vllm serve`, all of its
processes) core 0, the learner (and its grader, its HTTP client, its weight writes) core 1.
Measured in one run of this script, on one of two tasks (`--task`):

- `quickstart`: the quickstart recipes as they are; every answer is a few tokens long.
- `long-tail`: `builtin:tiny-qwen3-long-tail` with answers of up to 128 tokens: most short, some many
  times longer, some cut at the limit, as reasoning answers are, 4 prompts x 8 a step. A colocated
  step waits for its longest answers; separate mode's engine admits new prompts in their place. What
  the wait costs depends on the step's size against the batch at which an engine step's fixed cost
  equals its per-sequence cost (`bench/bench_engine_steps.py`); `--prompts-per-step` changes it.

1. **Each side alone**, through separate mode's own code, in a child process: the producer gathers
   `--steps` steps' worth of groups from the server with the learner idle (generation alone, per
   step); then it generates `--steps / 2` steps again in batches, each step's prompts together and the
   next step's once the last answer is in, as colocated mode generates (in batches / alone is what
   the long tail costs a step that waits for it); then the learner settles (grades, packs) and trains
   on the groups, pushing its weights to the server every `sync_every` updates, with the engine idle
   (training alone, per step).
2. **Separate**: `m2po train` in separate mode, both sides at once, each on its core.
3. **Colocated on both cores**: `m2po train` in colocated mode, the mode separate mode must beat.

The three are measured in turn `--repeats` times, so the baseline moves with the machine as the runs
do; each repeat's overlap efficiency divides by its own baseline, and every figure is printed as the
median with each repeat's value.

Printed: the time per step and samples/s of each, the overlap efficiency
`max(generate, train) / separate time per step` (1.0 is a perfect overlap; the figure that carries to
GPUs, where each side has its own devices), separate over colocated samples/s, the answer lengths
(median, p90, p99, max, the share cut at the limit), the learner's and the engine's idle fractions
(the engine's split by why), the engine's tokens/s while not idle against generation alone's, the
mean staleness, and the share of generated tokens that were trained. Steady state: the first
`--warmup` steps of every run are left out. `--staleness` and `--sync-every` override
quickstart-separate.toml's `max_staleness` and `sync_every`.

    .venv/bin/python bench/bench_overlap.py [--task quickstart|long-tail] [--repeats 3]
        [--steps N] [--warmup N] [--prompts-per-step P] [--staleness S] [--sync-every U]

What it predicts for the 8B recipe is worked out in docs/staleness.md.
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

ROOT = Path(__file__).resolve().parents[1]


SETS = [
    "run.seed=0",
    "checkpoint.every=0",
    "checkpoint.export_hf=false",
    "inspect.every=0",
    'logging.console="plain"',
]
# The two workloads, as changes to the quickstart recipes. `long-tail`: the model writes a geometric
# number of worked lines before its answer (builtin:tiny-qwen3-long-tail), so answers are mostly
# short, some many times longer, and some cut at max_new_tokens; a colocated step waits for its
# longest answers, separate mode's engine admits new prompts in their place.
TASKS = {
    "quickstart": [],
    "long-tail": [
        'model.path="builtin:tiny-qwen3-long-tail"',
        "rollout.max_new_tokens=128",
        # Slow learning, as at lr 1e-6 on a large model: the lengths stay what they are for the
        # whole run (at the quickstart's 5e-4 the policy stops writing long answers within a few
        # steps and the task is a short-answer task again).
        "optim.lr=5e-5",
        # Rows sorted by length and cut at a token budget, so short rows are not padded to long ones.
        "train.micro_batch_tokens=4096",
        # 4 prompts x 8 = 32 sequences a step, near the batch B* at which a CPU engine step's fixed
        # cost equals its per-sequence cost (bench/bench_engine_steps.py: about 24), as an 8B engine's
        # batch is a few times its own B*. At 32 prompts a step (256 sequences, 11 B*) a CPU step
        # costs in proportion to its sequences and a thinning tail is cheap (`--prompts-per-step 32`).
        "rollout.prompts_per_step=4",
    ],
}
# Steps and warm-up per task: a long-tail step is 8x smaller, and its buffer fills in about
# max_staleness steps.
LENGTHS = {"quickstart": (40, 8), "long-tail": (120, 16)}
ENGINE_CORE, LEARNER_CORE = 0, 1
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE)}


def run(name: str, recipe: str, sets: list[str], pinned: bool, out: Path) -> list[dict]:
    """One `m2po train` run (pinned: the learner on its core, one thread; else every core); its
    metrics, one dict per step."""
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(ROOT / "recipes" / recipe)]
    cmd += [a for s in [f'run.output_dir="{out}"', f'run.name="{name}"', *SETS, *sets] for a in ("--set", s)]
    cores = {LEARNER_CORE} if pinned else set(range(os.cpu_count() or 1))
    env = {**os.environ, **ONE_THREAD} if pinned else os.environ
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores)
    )
    if done.returncode:
        sys.exit(f"{name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def alone(args: argparse.Namespace, out: Path) -> tuple[float, float]:
    """Seconds per step of generation alone and of the learner's side alone (separate mode's code,
    this process on the learner's core with one thread, the server on the engine's core)."""
    import torch

    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.device import resolve_dtype, torch_dtype
    from m2po_cli.grader import Grader, grader_workers
    from m2po_cli.learner.policy import Learner
    from m2po_cli.loss import build_loss
    from m2po_cli.models import load_tokenizer, resolve_model
    from m2po_cli.record import Recorder
    from m2po_cli.rollout.producer import RolloutProducer
    from m2po_cli.rollout.server import EngineServer
    from m2po_cli.rollout.transport import ShmWeightTransport
    from m2po_cli.rollout.types import Finished, Ticket
    from m2po_cli.schedule import Schedule
    from m2po_cli.train.packed import PackedRollouts
    from m2po_cli.train.reuse import plan_passes
    from m2po_cli.train.separate import settle
    from m2po_cli.train.updates import train_on

    torch.set_num_threads(1)
    sets = [f'run.output_dir="{out}"', 'run.name="alone"', *SETS, *separate_sets(args)]
    recipe = load_recipe(ROOT / "recipes" / "quickstart-separate.toml", sets)
    model_dir = resolve_model(recipe.model.path)
    steps, per_step = args.steps, recipe.rollout.prompts_per_step
    prompts = PromptBatches(load_problems(recipe.data), load_tokenizer(model_dir), recipe.data, per_step)
    server = EngineServer.start(
        model_dir, recipe.rollout, resolve_dtype(recipe.model.dtype), recipe.max_model_len, out / "engine.log"
    )
    try:
        server.set_version(0)
        server.check({}, recipe.max_model_len)  # reads its concurrency
        # Generation alone: every step's groups admitted at once, the learner idle.
        schedule = Schedule(per_step, per_step, recipe.rollout.n)
        producer = RolloutProducer([server], prompts, recipe.rollout, schedule, steps, 0)
        producer.start()
        producer.take(per_step, 0)  # the engine warms up
        t0 = time.perf_counter()
        groups = [producer.take(per_step, 0) for _ in range(1, steps)]
        generate = (time.perf_counter() - t0) / (steps - 1)
        producer.stop()
        lengths = [(len(c.token_ids), not c.finished) for g in groups for group in g for c in group.rows]
        # Generation alone in batches, as colocated mode generates: a step's prompts admitted together
        # (a bound of 0 at version 0 admits one step), the next step's once the last one has finished.
        t0 = time.perf_counter()
        for _ in range(args.steps // 2):
            batch_producer = RolloutProducer([server], prompts, recipe.rollout, schedule, 0, 0)
            batch_producer.start()
            batch_producer.take(per_step, 0)
            batch_producer.stop()
        in_batches = (time.perf_counter() - t0) / (args.steps // 2)
        # The learner's side alone: settle, train, push to the (idle) engine as separate mode does.
        learner = Learner(model_dir, recipe)
        recorder = Recorder(out, recipe.inspect, 0, 0, 1)
        dtype = torch_dtype(recipe.model.dtype)
        transport = ShmWeightTransport(0, recipe.rollout.sync_every, dtype, producer.swap, "bench-overlap")
        loss_fn = build_loss(recipe.loss)
        with Grader(num_workers=grader_workers(1)) as grader:
            times = []
            for step, taken in enumerate(groups):
                t0 = time.perf_counter()
                finished = [Finished(Ticket(g.epoch, g.prompt), g.version, g.rows) for g in taken]
                rows = settle(finished, grader, recipe)
                batch = PackedRollouts.cat(rows, torch.arange(len(rows) * recipe.rollout.n))
                train_on(
                    plan_passes(batch, Schedule.of(recipe)),
                    learner,
                    loss_fn,
                    transport.after_update,
                    recipe,
                    recorder,
                    step,
                )
                times.append(time.perf_counter() - t0)
        transport.close()
        train = sum(times[args.warmup :]) / len(times[args.warmup :])
        return generate, train, lengths, in_batches
    finally:
        server.close()


def task_sets(args: argparse.Namespace) -> list[str]:
    """The task's changes to either quickstart recipe, and the run's length."""
    sets = [*TASKS[args.task], f"run.steps={args.steps}"]
    return sets + ([f"rollout.prompts_per_step={args.prompts_per_step}"] if args.prompts_per_step else [])


def separate_sets(args: argparse.Namespace) -> list[str]:
    """The task's and the command line's changes to quickstart-separate.toml."""
    sets = task_sets(args)
    if args.staleness is not None:
        sets.append(f"staleness.max_staleness={args.staleness}")
    if args.sync_every is not None:
        sets.append(f"rollout.sync_every={args.sync_every}")
    return sets


def alone_in_child(args: argparse.Namespace, out: Path) -> tuple[float, float, list, float]:
    """`alone` in a fresh process pinned as separate mode pins its learner (this script again,
    `--alone-only`), so each repeat's baseline starts as cold as its runs; its figures."""
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--alone-only", str(out), "--task", args.task]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--prompts-per-step", str(args.prompts_per_step)] if args.prompts_per_step else []
    cmd += ["--sync-every", str(args.sync_every)] if args.sync_every is not None else []
    cmd += ["--staleness", str(args.staleness)] if args.staleness is not None else []
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
        preexec_fn=lambda: os.sched_setaffinity(0, {LEARNER_CORE}),
    )
    if done.returncode:
        sys.exit(f"the alone phase failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    print(f"  alone: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    generate, train, lengths, in_batches = json.loads(done.stdout.strip().splitlines()[-1])
    return generate, train, lengths, in_batches


def mean(steps: list[dict], key: str) -> float:
    return sum(m[key] for m in steps) / len(steps)


def tokens_per_s(runs: list[list[dict]], samples: int) -> float:
    """Response tokens trained per second, the median over runs (samples/s alone would favour the
    mode whose policy happens to write shorter answers)."""
    return statistics.median(
        sum(m["rollout/response_tokens_mean"] * samples for m in steps) / sum(m["time/step"] for m in steps)
        for steps in runs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="quickstart")
    parser.add_argument(
        "--steps", type=int, help="steps of every run (default: quickstart 40, long-tail 120)"
    )
    parser.add_argument("--warmup", type=int, help="steps left out of every figure (default: 8, 16)")
    parser.add_argument("--prompts-per-step", type=int, help="the task's rollout.prompts_per_step, changed")
    parser.add_argument("--staleness", type=int, help="separate mode's max_staleness (default: the recipe's)")
    parser.add_argument(
        "--sync-every", type=int, help="separate mode's rollout.sync_every (default: the recipe's)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="each side alone, separate, colocated, in turn"
    )
    parser.add_argument("--alone-only", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps, warmup = LENGTHS[args.task]
    args.steps = args.steps or steps
    args.warmup = args.warmup if args.warmup is not None else warmup
    if args.alone_only:
        print(json.dumps(alone(args, args.alone_only)))
        return
    if (os.cpu_count() or 1) < 2:
        sys.exit("this benchmark gives each side a core of its own: it needs at least 2")
    separate, colocated, whole, baselines = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(
            "running: each side alone, then separate (a core each) and colocated (both cores)",
            file=sys.stderr,
        )
        for r in range(args.repeats):
            baselines.append(alone_in_child(args, out / f"alone-{r}"))
            sets = separate_sets(args)
            whole.append(run(f"separate-{r}", "quickstart-separate.toml", sets, True, out))
            separate.append(whole[-1][args.warmup :])
            sets = [*task_sets(args), "staleness.s=0"]
            colocated.append(run(f"colocated-{r}", "quickstart.toml", sets, False, out)[args.warmup :])
    from m2po_cli.config import load_recipe

    rollout = load_recipe(ROOT / "recipes" / "quickstart-separate.toml", separate_sets(args)).rollout
    samples = rollout.prompts_per_step * rollout.n
    sep_steps = [mean(steps, "time/step") for steps in separate]
    col_steps = [mean(steps, "time/step") for steps in colocated]
    sep_step, col_step = statistics.median(sep_steps), statistics.median(col_steps)
    generates, trains = [b[0] for b in baselines], [b[1] for b in baselines]
    lengths = sorted(n for b in baselines for n, _ in b[2])
    cut = sum(c for b in baselines for _, c in b[2]) / len(lengths)
    quantile = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    batched = [b[3] for b in baselines]
    generate, train = statistics.median(generates), statistics.median(trains)
    in_batches = statistics.median(batched)
    every = [m for steps in separate for m in steps]
    # Over whole runs: what the engines generated, and what of it was trained before the run ended.
    trained_tokens = sum(m["rollout/response_tokens_mean"] * samples for steps in whole for m in steps)
    generated_tokens = sum(m["rollout/generated_tokens"] for steps in whole for m in steps)
    each = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    rows = [
        ("generation alone, one core", f"{generate:.3f} s/step", f"({each(generates)})"),
        (
            "generation alone in batches, one core",
            f"{in_batches:.3f} s/step",
            f"({each(batched)}); the long tail's cost, in batches / alone: {in_batches / generate:.2f}x",
        ),
        ("learner alone, one core", f"{train:.3f} s/step", f"({each(trains)})"),
        (
            "separate, one core each",
            f"{sep_step:.3f} s/step",
            f"{samples / sep_step:.0f} samples/s  {tokens_per_s(separate, samples):.0f} tokens/s  ({each(sep_steps)})",
        ),
        (
            "colocated, both cores",
            f"{col_step:.3f} s/step",
            f"{samples / col_step:.0f} samples/s  {tokens_per_s(colocated, samples):.0f} tokens/s  ({each(col_steps)})",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(
        f"\n{args.task} task, {rollout.prompts_per_step} x {rollout.n} samples per step, steps {args.warmup}..{args.steps - 1}, "
        f"medians of {args.repeats} runs:"
    )
    for name, step, rate in rows:
        print(f"  {name:<{width}}  {step:>13}  {rate}")
    print(
        f"  answer lengths, generation alone (the initial policy, {len(lengths)} answers): median "
        f"{quantile(0.5)}, p90 {quantile(0.9)}, p99 {quantile(0.99)}, max {lengths[-1]} tokens; "
        f"{100 * cut:.1f}% cut at the limit"
    )
    for name, steps in (("separate", separate), ("colocated", colocated)):
        every_step = [m for s in steps for m in s]
        print(
            f"  answer lengths, {name} runs: mean {mean(every_step, 'rollout/response_tokens_mean'):.1f} "
            f"tokens, {100 * mean(every_step, 'rollout/truncated_frac'):.1f}% cut"
        )
    # The engine's speed while it works: the tokens it returned per second not idle, against generation
    # alone's tokens per second (what it loses to recomputing kept requests' KV cache after each sync,
    # and to sharing the machine with the learner).
    alone_speeds = [sum(n for n, _ in b[2]) / (b[0] * (args.steps - 1)) for b in baselines]
    busy_speeds = [
        sum(m["rollout/generated_tokens"] for m in steps)
        / sum(m["time/step"] * (1 - m["perf/engine_idle_frac"]) for m in steps)
        for steps in separate
    ]
    print(
        f"  engine tokens/s while not idle, separate over generation alone: "
        f"{statistics.median(b / a for a, b in zip(alone_speeds, busy_speeds, strict=True)):.2f} "
        f"({statistics.median(busy_speeds):.0f} against {statistics.median(alone_speeds):.0f})"
    )
    efficiencies = [max(b[:2]) / x for b, x in zip(baselines, sep_steps, strict=True)]
    print(
        f"  overlap efficiency max(generate, train) / separate, each against its repeat's baseline: "
        f"{statistics.median(efficiencies):.2f} ({each(efficiencies)})"
    )
    print(f"  separate / colocated samples/s: {col_step / sep_step:.2f}x")
    print(
        f"  separate idle: learner {100 * mean(every, 'perf/learner_idle_frac'):.1f}%, "
        f"engine {100 * mean(every, 'perf/engine_idle_frac'):.1f}% (paused for syncs "
        f"{100 * mean(every, 'perf/engine_idle_sync_frac'):.1f}%, held by the bound "
        f"{100 * mean(every, 'perf/engine_idle_bound_frac'):.1f}%, nothing in flight otherwise "
        f"{100 * mean(every, 'perf/engine_idle_starved_frac'):.1f}%); mean staleness "
        f"{mean(every, 'staleness/mean'):.2f} updates"
    )
    print(
        f"  generated tokens trained: {100 * trained_tokens / max(generated_tokens, 1):.1f}% "
        f"(the rest was in flight or buffered when the runs ended; regenerated requests: "
        f"{sum(m['rollout/regenerated'] for steps in whole for m in steps):.0f})"
    )


if __name__ == "__main__":
    main()
