"""Device memory of one GPU of a colocated run, phase by phase, from the code's own sizes; checks that
the engine wakes with room to spare.

Sizes come from the code and the recipe: every parameter's shape from torchtitan's build of the
model's config (on the meta device, no weights), the learner's state (fp32 master weights sharded by
FSDP2, two fp32 AdamW moments, fp32 gradients between the backward and `zero_grad`), the recipe's
micro-batch at its longest, its activation checkpointing, its sleep level and engine share, the
output head's logits chunk (`logprobs.CHUNK_LOGITS`), the push's largest tensor gathered in fp32
and cast to the serving dtype (`HFWeights.stream`), and `release_cached_memory` before each wake.
What CUDA and vLLM decide (the CUDA context and NCCL buffers, the CUDA graphs' pool, the engine's
profiled activations) are estimates, marked `~`; `scripts/gpu_check.sh` measures them.

    .venv/bin/python bench/memory_budget.py [--recipe R] [--ranks 8] [--gpu-gb 80] [--shape qwen3-8b]

Prints a markdown table (docs/cluster.md keeps the 8B one) and exits 1 if less than `--margin-gb`
(5) is free at a wake or during the push.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from local_model import QWEN3_8B, Qwen3Shape, write_qwen3_config

from m2po_cli.config import Recipe, load_recipe
from m2po_cli.learner.logprobs import chunk_size
from m2po_cli.titan import load_arch

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
SHAPES = {"qwen3-8b": QWEN3_8B}
# Estimates (measured by scripts/gpu_check.sh on the target GPU).
CONTEXT_AND_NCCL = 1.5 * GB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL communicators: one process
CUDA_GRAPHS = 1.5 * GB  # vLLM's graph pool, kept while the engine sleeps
# vLLM's offline defaults on an 80 GB H100/H200 (`EngineArgs`): the profile run's batch.
ENGINE_BATCHED_TOKENS, ENGINE_MAX_SEQS = 16_384, 1024


@dataclass(frozen=True)
class Sizes:
    """Parameter counts by part, from the built model."""

    total: int
    layer: int
    largest: int  # elements of the largest single tensor (the push gathers one at a time)
    num_layers: int


def model_sizes(shape: Qwen3Shape) -> Sizes:
    with tempfile.TemporaryDirectory() as tmp:
        arch = load_arch(write_qwen3_config(Path(tmp), shape))
        with torch.device("meta"):
            model = arch.build()
    numels = {name: p.numel() for name, p in model.named_parameters()}
    layer = sum(n for name, n in numels.items() if name.startswith("layers.0."))
    return Sizes(sum(numels.values()), layer, max(numels.values()), len(model.layers))


def budget(recipe: Recipe, shape: Qwen3Shape, ranks: int, gpu: float) -> tuple[list[tuple], dict]:
    """(phase, what is resident, bytes in use, bytes in use without the release) rows, and figures."""
    s = model_sizes(shape)
    d, hd, vocab = shape.hidden_size, shape.head_dim, shape.vocab_size
    heads, kv_heads, mlp = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    serve = 2  # bf16 serving weights and compute
    # Learner, per rank.
    master, adam, grads = 4 * s.total / ranks, 8 * s.total / ranks, 4 * s.total / ranks
    tokens = recipe.train.micro_batch_sequences * (
        recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens
    )
    per_token_layer = 4 * d + (heads + 2 * kv_heads) * hd + heads * hd + 3 * mlp  # values saved for backward
    if recipe.train.activation_checkpointing == "full":
        kept = s.num_layers * tokens * d * serve  # each layer's input
        recompute = 2 * tokens * per_token_layer * serve  # one layer's activations and their gradients
    else:
        kept, recompute = s.num_layers * tokens * per_token_layer * serve, tokens * per_token_layer * serve
    gathered = 2 * s.layer * serve + 2 * s.layer * 4  # FSDP2: this and the prefetched layer, bf16; fp32 grads
    chunk = chunk_size(vocab) * vocab * (2 + 4 + 4 + 4)  # bf16 logits, fp32 copy, log-softmax, its grad
    head = vocab * d * (serve + 4) + 2 * tokens * d * serve + chunk  # whole head and its fp32 grad; h and dh
    learner_kept = master + adam  # between updates (gradients freed by zero_grad)
    learner_peak = master + adam + grads + kept + max(recompute + gathered, head)
    cached = learner_peak - learner_kept  # what the allocator holds after an update unless released
    # Engine, per rank (tensor_parallel_size 1).
    weights = serve * s.total
    activation = (
        ENGINE_BATCHED_TOKENS * (3 * mlp + (heads + 2 * kv_heads) * hd + 2 * d) * serve
        + ENGINE_MAX_SEQS * vocab * 4 * 3  # sampler: fp32 logits, softmax, processed logprobs
    )
    engine_share = recipe.rollout.gpu_memory_utilization * gpu
    kv = engine_share - weights - activation - CUDA_GRAPHS
    push = s.largest * (4 + serve)  # the largest tensor gathered in fp32, and its cast
    base = CONTEXT_AND_NCCL + CUDA_GRAPHS  # the process, and the engine asleep (level 2)
    rows = [
        (
            "engine start",
            "context, learner's fp32 shards (AdamW state comes at the first update)",
            CONTEXT_AND_NCCL + master,
            CONTEXT_AND_NCCL + master,
        ),
        (
            "train, engine asleep (peak)",
            "learner state, gradients, kept layer inputs, one layer recomputed",
            base + learner_peak,
            base + learner_peak,
        ),
        (
            "wake: weights",
            "learner state + engine weights",
            base + learner_kept + weights,
            base + learner_kept + cached + weights,
        ),
        (
            "push (largest tensor in flight)",
            "+ one parameter gathered in fp32 and cast",
            base + learner_kept + weights + push,
            base + learner_kept + cached + weights + push,
        ),
        (
            "wake: KV cache",
            "+ KV cache",
            base + learner_kept + weights + kv,
            base + learner_kept + cached + push + weights + kv,
        ),
        (
            "generate (peak)",
            "+ the engine's activations",
            base + learner_kept + weights + kv + activation,
            base + learner_kept + cached + push + weights + kv + activation,
        ),
    ]
    figures = dict(
        params=s.total,
        tokens=tokens,
        kv=kv,
        kv_tokens=kv / (2 * s.num_layers * kv_heads * hd * serve),
        engine_share=engine_share,
        cached=cached,
        push=push,
        host_copy_level1=weights,
    )
    return rows, figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "qwen3-8b-s256.toml")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--margin-gb", type=float, default=5.0)
    args = ap.parse_args()
    recipe, gpu = load_recipe(args.recipe), args.gpu_gb * GB
    rows, f = budget(recipe, SHAPES[args.shape], args.ranks, gpu)
    print(
        f"{args.recipe.name}: {f['params'] / 1e9:.2f} B parameters, {args.ranks} ranks, {args.gpu_gb:g} GB "
        f"GPU, micro-batch {f['tokens']:,} tokens, engine share {f['engine_share'] / GB:.1f} GB "
        f"(KV cache {f['kv'] / GB:.1f} GB, ~{f['kv_tokens'] / 1e3:.0f}k tokens)\n"
    )
    print("| phase | resident | in use | free | free without releasing cached blocks |")
    print("|---|---|---|---|---|")
    for phase, what, used, unreleased in rows:
        print(
            f"| {phase} | {what} | ~{used / GB:.1f} GB | ~{(gpu - used) / GB:.1f} GB | ~{(gpu - unreleased) / GB:.1f} GB |"
        )
    print(
        f"\nAllocator cache after an update, returned before each wake: ~{f['cached'] / GB:.1f} GB. "
        f"Host RAM kept by sleep level 1 (refused): {f['host_copy_level1'] / GB:.1f} GB a rank, "
        f"{args.ranks * f['host_copy_level1'] / GB:.0f} GB for {args.ranks} ranks; level 2: none."
    )
    problem, least = verdict(rows, f, gpu, args.margin_gb * GB)
    if problem and f["kv"] <= 0:
        print(f"{problem}: FAILED")
        return 1
    print(
        f"least free at a wake or the push: {least / GB:.1f} GB ({'FAILED' if problem else 'ok'}: margin {args.margin_gb:g} GB)"
    )
    return 1 if problem else 0


def verdict(rows: list[tuple], figures: dict, gpu: float, margin: float) -> tuple[str | None, float]:
    """What does not fit (None if everything does), and the least memory free at a wake or the push."""
    least = min(gpu - used for phase, _, used, _ in rows if phase.startswith(("wake", "push")))
    if figures["kv"] <= 0:
        return f"the engine's share ({figures['engine_share'] / GB:.1f} GB) leaves no KV cache", least
    if least < margin:
        return f"{least / GB:.1f} GB free at a wake or the push, under the {margin / GB:g} GB margin", least
    return None, least


if __name__ == "__main__":
    sys.exit(main())
