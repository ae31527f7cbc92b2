"""Throughput of `m2po eval` against raw `vllm.LLM.generate` on the same prompts, in one engine.

The eval path is everything `m2po eval` does per checkpoint once its engine and grader are up:
tokenize the prompts through the chat template, submit them, grade every sample as it finishes and
append it to the cache files, then compute the scores. The raw path is one `LLM.generate` call on
the same token ids with the same sampling parameters, each sample its own request with the eval's
seed. Both start from an empty prefix cache and sample the same tokens (checked): the work is equal and the ratio measures
the eval's overhead. Engine and grader start-up, the same for both, are not timed. Prints samples/s
of each (best of `--repeats`, interleaved) and the ratio; exits 1 below 0.9.

    .venv/bin/python bench/bench_eval.py [--model builtin:tiny-qwen3] [--problems 32] [--samples 4]
        [--max-new-tokens 128] [--data-dir ../shared/benchmarks] [--repeats 5]

The default model generates fast, which makes the eval's own overhead show most; pass
`--model builtin:smollm2-135m-instruct` (slow on a CPU) for a real model's responses. On a shared,
loaded CPU single runs vary by several times: the best of the interleaved repeats is compared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from m2po_cli.eval.config import load_benchmarks, load_eval_config
from m2po_cli.eval.data import load_problems
from m2po_cli.eval.evaluate import build_eval_llm, context_length, plan_target, run_jobs, target_episodes
from m2po_cli.eval.report import summarize_benchmark
from m2po_cli.eval.sampling import sample_seed, sampling_params
from m2po_cli.eval.targets import Target
from m2po_cli.grader import Grader
from m2po_cli.models import resolve_model

MIN_RATIO = 0.9
ROOT = Path(__file__).resolve().parents[1]


def raw_generate(llm, jobs, protocol) -> tuple[float, int]:
    """(seconds, generated tokens) of one `LLM.generate` over the jobs' prompts."""
    from vllm import TokensPrompt

    samples = [(j, i) for j in jobs for i in j.samples]  # each its own seeded request, as the eval sends
    prompts = [TokensPrompt(prompt_token_ids=j.prompt_ids) for j, _ in samples]
    params = [sampling_params(protocol, sample_seed(protocol, j, i), j.max_tokens) for j, i in samples]
    _reset(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for out in outputs for c in out.outputs)


def eval_path(llm, grader, target, model_dir, specs, problems, cfg) -> tuple[float, int, int]:
    """(seconds, generated tokens, samples with a box) of the eval's plan, generate-and-grade and
    summary, from an empty cache."""
    quiet = Console(quiet=True)
    with tempfile.TemporaryDirectory() as out:
        _reset(llm)
        start = time.perf_counter()
        plans = plan_of(target, model_dir, specs, problems, cfg, Path(out))
        jobs = [j for p in plans for j in p.jobs]
        run_jobs(llm, grader, jobs, cfg.protocol, {p.spec.name: p for p in plans}, quiet)
        for p in plans:
            summarize_benchmark(p)
        seconds = time.perf_counter() - start
        records = [r for p in plans for r in p.records.values()]
        return seconds, sum(r["tokens"] for r in records), sum(r["answer"] is not None for r in records)


def plan_of(target, model_dir, specs, problems, cfg, out: Path) -> list:
    """The eval's plan of `target` (its episodes included), with an empty cache under `out`."""
    return plan_target(
        target, model_dir, specs, problems, cfg, out, None, target_episodes(cfg, model_dir, target.path)
    )


def _reset(llm) -> None:
    llm.reset_prefix_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-qwen3")
    parser.add_argument("--benchmark", default="math500")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "benchmarks")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cfg = load_eval_config(
        None, [f"protocol.samples={args.samples}", f"protocol.max_new_tokens={args.max_new_tokens}"]
    )
    specs = load_benchmarks([args.benchmark])
    problems = {args.benchmark: load_problems(specs[0], args.data_dir)[: args.problems]}
    model_dir = resolve_model(args.model)
    target = Target(args.model, "model", str(model_dir))
    llm = build_eval_llm(model_dir, cfg.engine, context_length(model_dir, cfg))
    with Grader(cfg.grader.workers, cfg.grader.timeout_s) as grader:
        # The prompts, token for token, as the eval builds them.
        with tempfile.TemporaryDirectory() as out:
            (plan,) = plan_of(target, model_dir, specs, problems, cfg, Path(out))
        raw_generate(llm, plan.jobs[:1], cfg.protocol)  # warm-up
        raw_runs, eval_runs = [], []
        for i in range(args.repeats):
            raw_runs.append(raw_generate(llm, plan.jobs, cfg.protocol))
            eval_runs.append(eval_path(llm, grader, target, model_dir, specs, problems, cfg))
            print(f"repeat {i}: raw {raw_runs[-1][0]:.2f} s, eval {eval_runs[-1][0]:.2f} s", flush=True)
    llm.llm_engine.engine_core.shutdown()

    num_samples = sum(len(j.samples) for j in plan.jobs)
    raw_s, raw_tokens = min(raw_runs)
    eval_s, eval_tokens, boxed = min(eval_runs)
    ratio = raw_s / eval_s
    print(
        f"model {args.model}, {args.benchmark}: {len(plan.jobs)} prompts x {args.samples} samples, "
        f"up to {args.max_new_tokens} new tokens, top_p {cfg.protocol.top_p}"
    )
    print(f"raw vLLM generate: {num_samples / raw_s:8.2f} samples/s  ({raw_tokens} tokens, {raw_s:.2f} s)")
    print(
        f"m2po eval path:    {num_samples / eval_s:8.2f} samples/s  ({eval_tokens} tokens, {eval_s:.2f} s; {boxed} boxed answers graded by math-verify)"
    )
    print(f"eval / raw throughput: {ratio:.3f} (must be >= {MIN_RATIO})")
    if {t for _, t in raw_runs} | {t for _, t, _ in eval_runs} != {raw_tokens}:
        print(f"note: runs generated different token counts: raw {raw_runs}, eval {eval_runs}")
    return 0 if ratio >= MIN_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
