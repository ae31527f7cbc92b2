"""What a decode step of the CPU engine costs, and so what a long tail costs a batch that waits for it.

A rollout batch generated all at once (colocated mode) runs until its longest answer ends; as its
answers finish, each step carries fewer sequences. Whether that costs time depends on how a step's
cost grows with the sequences in it: `a + b x B`. Far above `B* = a / b` a step costs in proportion
to its sequences and a thinning tail is cheap; near or below `B*` the fixed part dominates and every
step of the tail costs nearly a full one. (On a GPU the fixed part is reading the weights: about
5 ms per step for Qwen3-8B's 16.4 GB on an H100, against about 0.1 ms per sequence for its KV cache
and FLOPs; docs/staleness.md works it out.)

One engine (`vllm.LLM` in this process, the project's engine settings) on one core, one thread:

1. **The step's cost**: `--lengths` tokens for each of B sequences (the end of text ignored), B from
   1 to 256; ms per step and us per token, and the least-squares fit `a + b x B`.
2. **The tail's cost**: the long-tail task's prompts (`builtin:tiny-qwen3-long-tail`, answers up to
   128 tokens), `--prompts` of them x n, generated in batches of P prompts one after the other (as
   colocated mode does, P the step's prompts) and all at once (as a stream at full occupancy); every
   request carries its own seed, so both generate the same tokens. Printed: the time of each and their
   ratio, the tail's cost at P, beside P x n / B*.

    .venv/bin/python bench/bench_engine_steps.py [--prompts 64] [--lengths 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_overlap import ENGINE_CORE, ONE_THREAD, TASKS  # noqa: E402

BATCHES = [1, 4, 16, 32, 64, 128, 256]
PROMPTS_PER_BATCH = [4, 8, 16, 32]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of cost = a + b x B over (B, cost) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the tail's measurement")
    parser.add_argument(
        "--lengths", type=int, default=64, help="tokens per sequence of the step's measurement"
    )
    args = parser.parse_args()
    if args.prompts % max(PROMPTS_PER_BATCH):
        sys.exit(f"--prompts must be a multiple of {max(PROMPTS_PER_BATCH)}")
    os.environ.update(ONE_THREAD)
    os.sched_setaffinity(0, {ENGINE_CORE})

    import torch
    from vllm import SamplingParams, TokensPrompt

    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.device import resolve_dtype
    from m2po_cli.models import load_tokenizer, resolve_model
    from m2po_cli.rollout.engine import VLLMEngine
    from m2po_cli.rollout.settings import request_seed

    torch.set_num_threads(1)
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", TASKS["long-tail"])
    model_dir = resolve_model(recipe.model.path)
    engine = VLLMEngine(model_dir, recipe.rollout, resolve_dtype(recipe.model.dtype), recipe.max_model_len)
    prompts = PromptBatches(load_problems(recipe.data), load_tokenizer(model_dir), recipe.data, args.prompts)
    tokens = [p.token_ids for p in next(prompts)]
    n = recipe.rollout.n

    print(f"1. the step's cost: B sequences x {args.lengths} tokens, one core")
    points = []
    for batch in BATCHES:
        params = SamplingParams(max_tokens=args.lengths, min_tokens=args.lengths, ignore_eos=True, logprobs=0)
        requests = [TokensPrompt(prompt_token_ids=tokens[i % len(tokens)]) for i in range(batch)]
        engine.llm.generate(requests, params, use_tqdm=False)  # the same shapes once, then timed
        t0 = time.perf_counter()
        engine.llm.generate(requests, params, use_tqdm=False)
        ms = 1e3 * (time.perf_counter() - t0) / args.lengths
        points.append((batch, ms))
        print(f"  B = {batch:>3}  {ms:7.2f} ms/step  {1e3 * ms / batch:7.1f} us/token")
    a, b = fit(points)
    critical = a / b
    print(f"  fit: {a:.2f} ms + {1e3 * b:.1f} us x B;  B* = a / b = {critical:.0f} sequences")

    print(
        f"\n2. the tail's cost: {args.prompts} prompts x {n}, answers up to {recipe.rollout.max_new_tokens} tokens"
    )
    seeds = [request_seed(recipe.run.seed, 0, i) for i in range(args.prompts)]
    engine.generate(tokens[:8], seeds[:8])  # warm
    t0 = time.perf_counter()
    groups = engine.generate(tokens, seeds)
    together = time.perf_counter() - t0
    lengths = sorted(len(c.token_ids) for g in groups for c in g)
    print(
        f"  all at once: {together:.2f} s; answers: mean {sum(lengths) / len(lengths):.1f}, median "
        f"{lengths[len(lengths) // 2]}, p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]} tokens"
    )
    for per_batch in PROMPTS_PER_BATCH:
        t0 = time.perf_counter()
        batched = []
        for start in range(0, args.prompts, per_batch):
            batched += engine.generate(tokens[start : start + per_batch], seeds[start : start + per_batch])
        elapsed = time.perf_counter() - t0
        same = [[c.token_ids for c in g] for g in batched] == [[c.token_ids for c in g] for g in groups]
        print(
            f"  in batches of {per_batch:>2} prompts ({per_batch * n:>3} sequences, {per_batch * n / critical:4.1f} B*): "
            f"{elapsed:.2f} s, {elapsed / together:.2f}x all at once"
            + ("" if same else "  (the tokens differ from all at once: the comparison does not hold)")
        )
    engine.close()


if __name__ == "__main__":
    main()
