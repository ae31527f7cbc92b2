"""Per-token work in the colocated engine and the learner's logprob chunk: before and after, in one run.

1. **Generation** (`VLLMEngine.generate`, the in-process engine, one core, one thread). Before: the
   request as it was, vLLM detokenizing every sampled token (and every logprob entry) and building a
   logprob dict per token, each completion reading its `text` and `entry[token].logprob`. After: the
   engine's request (`detokenize=False`, `flat_logprobs`) and one decode of the batch's token ids on
   the run's side. Two random-weight models of `local_model.TINY`'s shape (built here, nothing from a
   hub) set the per-token work apart from the model's: its character tokenizer (128 tokens) and
   SmolLM2's byte-level BPE (49,152 tokens, from `builtin:smollm2-135m-instruct`'s folder). Rounds
   alternate the two on one engine. Printed: each round's and the median generated tokens/s; the
   peak of Python-heap allocations during one `generate` (tracemalloc: the per-token objects live
   there, the engine's tensors do not); and whether both give the same tokens, the same logprobs bit
   for bit and the same text.
2. **The learner's logprob head** (`chunked_logprobs`: forward, then backward through the checkpointed
   chunks, float32, with the entropy as the update computes it), at Qwen3's vocabulary (151,936) and
   `--hidden`: `CHUNK_LOGITS` 2**24 (110 positions a chunk) against the current one. Each run in a
   fresh process on the other core, one thread, the two alternating: an untimed step, then `STEPS`
   timed. Printed: median seconds a step, and the peak RSS above the RSS before the timed steps
   (Linux's VmHWM, reset then: every byte a step touched, the weight's gradient included), also in
   the chunk's float32 `[C, V]` logits once one weight gradient is taken off.

    .venv/bin/python bench/bench_engine_tokens.py [--prompts 16] [--max-tokens 128] [--rounds 4]
        [--hidden 256] [--positions 880] [--head-rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_overlap import ENGINE_CORE, LEARNER_CORE, ONE_THREAD  # noqa: E402
from local_model import TINY, write_qwen3  # noqa: E402

BEFORE_CHUNK = 2**24  # logits per chunk before
STEPS = 2  # timed head steps per process, after an untimed one
QWEN3_VOCAB = 151_936
INCOMPLETE = "\ufffd"  # a full decode's last character when its last bytes were never sampled


class Report:
    """Rows of before, after and the gain: before / after for a cost, after / before for a rate."""

    def __init__(self):
        print(f"{'':66s} {'before':>12s} {'after':>12s} {'gain':>8s}")

    def row(self, name: str, before: float, after: float, unit: str, rate: bool = False) -> None:
        gain = after / before if rate else before / after
        print(f"{name:66s} {before:>9.4g} {unit:<3s}{after:>9.4g} {unit:<3s}{gain:>7.2f}x", flush=True)


# --- 1. generation ----------------------------------------------------------------------------------


def bpe_model(out: Path) -> Path:
    """`TINY`'s shape, random weights, SmolLM2's tokenizer (its special tokens are the char one's)."""
    from transformers import AutoTokenizer

    from m2po_cli.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("builtin:smollm2-135m-instruct")))
    return write_qwen3(out, dataclasses.replace(TINY, vocab_size=len(tokenizer)), tokenizer=tokenizer)


def per_token_generate(engine, prompts: list[list[int]], seeds: list[int]):
    """`VLLMEngine.generate` as it was: vLLM's per-token text and logprob dicts."""
    from vllm import SamplingParams, TokensPrompt

    from m2po_cli.rollout.settings import rollout_sampling
    from m2po_cli.rollout.types import Completion

    params = [SamplingParams(**rollout_sampling(engine.cfg, seed)) for seed in seeds]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        [
            Completion(
                token_ids=list(c.token_ids),
                logprobs=[entry[tok].logprob for entry, tok in zip(c.logprobs, c.token_ids, strict=True)],
                text=c.text,
                finished=c.finish_reason == "stop",
                prompt_ids=out.prompt_token_ids,
            )
            for c in out.outputs
        ]
        for out in outputs
    ]


def timed(generate, prompts, seeds) -> tuple[float, list]:
    """Generated tokens per second of one call, and its completions."""
    t0 = time.perf_counter()
    groups = generate(prompts, seeds)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for g in groups for c in g) / seconds, groups


def heap_peak(generate, prompts, seeds) -> int:
    """Peak bytes of Python-heap allocations during one call, the completions it returns included."""
    tracemalloc.start()
    generate(prompts, seeds)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def same(before: list[list], after: list[list]) -> str:
    """How many completions have the same tokens and logprobs (bit for bit), and the same text; of
    the texts that differ, how many end inside a character (`INCOMPLETE`) where vLLM's does not."""
    pairs = [(b, a) for gb, ga in zip(before, after, strict=True) for b, a in zip(gb, ga, strict=True)]
    identical = sum((b.token_ids, b.logprobs) == (a.token_ids, a.logprobs) for b, a in pairs)
    differ = [(b, a) for b, a in pairs if b.text != a.text]
    cut = sum(a.text.endswith(INCOMPLETE) and a.text.startswith(b.text) for b, a in differ)
    return (
        f"tokens and logprobs bit-identical {identical}/{len(pairs)}; text equal {len(pairs) - len(differ)}"
        f"/{len(pairs)}, of the others {cut} end in an incomplete character (U+FFFD in the decode; vLLM "
        "holds its bytes back)"
    )


def compare_generation(report: Report, name: str, model_dir: Path, args) -> None:
    from m2po_cli.config import load_recipe
    from m2po_cli.rollout.engine import VLLMEngine
    from m2po_cli.rollout.settings import request_seed

    sets = [f'model.path="{model_dir}"', f"rollout.max_new_tokens={args.max_tokens}", "rollout.n=8"]
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", sets)
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len)
    rng = random.Random(0)
    text = [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(args.prompts)]
    prompts = [engine.tokenizer.encode(t) for t in text]
    modes = {"before": lambda p, s: per_token_generate(engine, p, s), "after": engine.generate}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    outputs = {}
    try:
        for round_ in range(-1, args.rounds):  # round -1 warms the engine up, untimed
            seeds = [request_seed(round_, 0, i) for i in range(args.prompts)]
            for mode, generate in modes.items():
                rate, outputs[mode] = timed(generate, prompts, seeds)
                if round_ >= 0:
                    rates[mode].append(rate)
        peaks = {mode: heap_peak(generate, prompts, seeds) for mode, generate in modes.items()}
    finally:
        engine.close()
    tokens = sum(len(c.token_ids) for g in outputs["after"] for c in g)
    print(f"{name}: {sum(map(len, outputs['after']))} completions, {tokens} tokens a round")
    print(f"  {same(**outputs)}")
    for mode, r in rates.items():
        print(f"  {mode}: tokens/s round by round {', '.join(f'{x:.0f}' for x in r)}")
    median = {mode: statistics.median(r) for mode, r in rates.items()}
    report.row(f"  generation, tokens/s (median of {args.rounds} rounds)", *median.values(), "/s", rate=True)
    report.row("  generation, us per token", 1e6 / median["before"], 1e6 / median["after"], "us")
    report.row(
        "  generate: Python-heap peak (tracemalloc)", peaks["before"] / 2**20, peaks["after"] / 2**20, "MiB"
    )


# --- 2. the learner's logprob head ------------------------------------------------------------------


def head_step(chunk_logits: int, hidden: int, positions: int) -> tuple[float, int]:
    """Median seconds of a forward + backward of the head over `positions` positions (`STEPS` steps,
    after one untimed), and the peak bytes above the RSS before them."""
    import torch

    from m2po_cli.learner import logprobs

    logprobs.CHUNK_LOGITS = chunk_logits
    g = torch.Generator().manual_seed(0)
    weight_VD = (torch.randn(QWEN3_VOCAB, hidden, generator=g) * 0.02).requires_grad_()
    h_ND = torch.randn(positions, hidden, generator=g).requires_grad_()
    targets_N = torch.randint(0, QWEN3_VOCAB, (positions,), generator=g)

    def step(n: int) -> None:
        request = logprobs.ScoreRequest(torch.arange(n), targets_N[:n], 1.0, with_entropy=True)
        lp_N, _ = logprobs.chunked_logprobs(h_ND[:n], weight_VD, None, request)
        lp_N.sum().backward()
        weight_VD.grad = h_ND.grad = None

    step(positions)  # untimed: the first step's allocations are slower, the chunk's the more
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss = vm("VmRSS")
    seconds = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step(positions)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), vm("VmHWM") - rss


def vm(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def compare_head(report: Report, args) -> None:
    from m2po_cli.learner.logprobs import CHUNK_LOGITS

    chunks = {"before": BEFORE_CHUNK, "after": CHUNK_LOGITS}
    runs: dict[str, list[tuple[float, int]]] = {mode: [] for mode in chunks}
    env = {**os.environ, **ONE_THREAD}
    for _ in range(args.head_rounds):
        for mode, chunk in chunks.items():
            cmd = [sys.executable, __file__, "--head-of", str(chunk), str(args.hidden), str(args.positions)]
            out = subprocess.run(
                cmd,
                env=env,
                capture_output=True,
                text=True,
                check=True,
                preexec_fn=lambda: os.sched_setaffinity(0, {LEARNER_CORE}),
            )
            seconds, peak = out.stdout.split()
            runs[mode].append((float(seconds), int(peak)))
    positions = {mode: min(args.positions, chunk // QWEN3_VOCAB) for mode, chunk in chunks.items()}
    print(
        f"logprob head, V = {QWEN3_VOCAB:,}, hidden {args.hidden}, {args.positions} positions, float32, "
        f"forward + backward: {positions['before']} -> {positions['after']} positions a chunk"
    )
    seconds = {mode: statistics.median(s for s, _ in r) for mode, r in runs.items()}
    peaks = {mode: max(p for _, p in r) for mode, r in runs.items()}
    report.row(f"  seconds (median of {args.head_rounds})", seconds["before"], seconds["after"], "s")
    report.row("  peak RSS above the step's start", peaks["before"] / 2**20, peaks["after"] / 2**20, "MiB")
    grad = QWEN3_VOCAB * args.hidden * 4  # the weight's gradient, the same in both
    buffers = [(peaks[mode] - grad) / (positions[mode] * QWEN3_VOCAB * 4) for mode in chunks]
    print("  the peak less one weight gradient, in a chunk's [C, V] float32 logits: ", end="")
    print(" and ".join(f"{b:.2f}" for b in buffers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generate (x 8 samples)")
    parser.add_argument("--max-tokens", type=int, default=128, help="rollout.max_new_tokens")
    parser.add_argument("--rounds", type=int, default=4, help="timed generate rounds of each mode")
    parser.add_argument("--hidden", type=int, default=256, help="the head's hidden size (8B: 4,096)")
    parser.add_argument("--positions", type=int, default=880, help="scored positions of the head's step")
    parser.add_argument("--head-rounds", type=int, default=3, help="runs of each head chunk")
    parser.add_argument("--head-of", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.head_of:
        import torch

        torch.set_num_threads(1)
        seconds, peak = head_step(*args.head_of)
        print(seconds, peak)
        return
    if (os.cpu_count() or 1) < 2:
        sys.exit("this benchmark runs the engine and the head on a core each: it needs at least 2")
    os.environ.update(ONE_THREAD)
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.sched_setaffinity(0, {ENGINE_CORE})
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "char tokenizer (128 tokens)": write_qwen3(Path(tmp) / "char", TINY),
            "SmolLM2's byte-level BPE (49,152 tokens)": bpe_model(Path(tmp) / "bpe"),
        }
        for name, model_dir in models.items():
            compare_generation(report, name, model_dir, args)
    compare_head(report, args)


if __name__ == "__main__":
    main()
