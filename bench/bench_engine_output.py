"""What the server's per-token text costs the engine: output_mode "tokens" against "text".

Separate mode asks `vllm serve` for token ids and behaviour logprobs only (`output_mode: tokens`,
`detokenize: false`) and decodes each response's text itself, on the learner's side. Asked for text,
the server detokenizes every sampled token and decodes a string (and its bytes) for every logprob
entry, on the engine's host CPU, in the API server process that shares the engine's core here.

One server on one core (core 0, one thread, as `bench/bench_overlap.py` pins it); this process on
the other core. Rounds alternate the two modes on the same server, `--steps` steps of the task's
groups each (a step: `prompts_per_step` prompts x n), so both see the same machine; printed: each
mode's median seconds per step over the rounds, each round's values, and text / tokens.

    .venv/bin/python bench/bench_engine_output.py [--task long-tail] [--steps 6] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_overlap import ENGINE_CORE, LEARNER_CORE, ONE_THREAD, TASKS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="long-tail")
    parser.add_argument("--steps", type=int, default=6, help="steps of groups per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each mode, alternating")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("this benchmark gives the server a core of its own: it needs at least 2")
    os.environ.update(ONE_THREAD)
    os.sched_setaffinity(0, {LEARNER_CORE})

    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.device import resolve_dtype
    from m2po_cli.models import load_tokenizer, resolve_model
    from m2po_cli.rollout import producer as producer_module
    from m2po_cli.rollout.producer import RolloutProducer
    from m2po_cli.rollout.server import EngineServer, sampling_body
    from m2po_cli.schedule import Schedule

    def text_body(prompt, cfg, seed, model):
        body = sampling_body(prompt, cfg, seed, model)
        return {
            **body,
            "output_mode": "text",
            "sampling_params": {**body["sampling_params"], "detokenize": True},
        }

    bodies = {"tokens": sampling_body, "text": text_body}
    recipe = load_recipe(ROOT / "recipes" / "quickstart-separate.toml", TASKS[args.task])
    model_dir = resolve_model(recipe.model.path)
    per_step = recipe.rollout.prompts_per_step
    prompts = PromptBatches(load_problems(recipe.data), load_tokenizer(model_dir), recipe.data, per_step)
    seconds: dict[str, list[float]] = {mode: [] for mode in bodies}
    with tempfile.TemporaryDirectory() as tmp:
        server = EngineServer.start(
            model_dir,
            recipe.rollout,
            resolve_dtype(recipe.model.dtype),
            recipe.max_model_len,
            Path(tmp) / "engine.log",
        )
        assert ENGINE_CORE not in os.sched_getaffinity(0)
        try:
            server.set_version(0)
            server.check({}, recipe.max_model_len)
            for round_ in range(-1, args.rounds):  # round -1 warms the engine up, untimed
                for mode, body in bodies.items():
                    producer_module.sampling_body = body
                    # A bound of steps - 1 at version 0 admits exactly the steps taken: nothing left in flight.
                    schedule = Schedule(per_step, per_step, recipe.rollout.n)
                    producer = RolloutProducer([server], prompts, recipe.rollout, schedule, args.steps - 1, 0)
                    producer.start()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        producer.take(per_step, 0)
                    if round_ >= 0:
                        seconds[mode].append((time.perf_counter() - t0) / args.steps)
                    producer.stop()
        finally:
            server.close()
    each = {mode: ", ".join(f"{x:.3f}" for x in xs) for mode, xs in seconds.items()}
    median = {mode: statistics.median(xs) for mode, xs in seconds.items()}
    print(f"{args.task} task, {per_step} x {recipe.rollout.n} samples per step, one core for the server:")
    for mode in bodies:
        print(f"  output_mode {mode:<6}  {median[mode]:.3f} s/step  ({each[mode]})")
    ratios = [a / b for a, b in zip(seconds["text"], seconds["tokens"], strict=True)]
    print(
        f"  text / tokens: {median['text'] / median['tokens']:.2f}x "
        f"(round by round {', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
