"""Device memory of one GPU of a colocated run, phase by phase, from the code's own sizes; checks that
the engine wakes with room to spare.

Sizes come from the code and the recipe: every parameter's shape from torchtitan's build of the
model's config (on the meta device, no weights), the learner's state (fp32 master weights sharded by
FSDP2, two fp32 AdamW moments, fp32 gradients between the backward and `zero_grad`), FSDP2's units
(`parallelize`: each block, then the root, which holds the embedding, the final norm and the lm head
and stays gathered from its forward to the end of the backward), the recipe's micro-batch at its
longest, its activation checkpointing, its sleep level and engine share, the output head's logits
chunk (`logprobs.CHUNK_LOGITS`), the push's largest tensor gathered in fp32 and cast to the serving
dtype (`HFWeights.stream`), and `release_cached_memory` before each wake. What CUDA and vLLM decide
(the CUDA context and NCCL buffers, the CUDA graphs' pool, the engine's profiled activations) are
estimates, marked `~`; `scripts/gpu_check.sh` measures them. The learner's training peak is checked
against the one GPU measurement there is (`MEASURED`, docs/performance.md).

    .venv/bin/python bench/memory_budget.py [--recipe R] [--ranks 8] [--gpu-gb 80] [--shape qwen3-8b]

Prints a markdown table (docs/cluster.md keeps the 8B one) and exits 1 if less than `--margin-gb`
(5) is free at a wake or during the push.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, replace
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
BF16, FP32 = 2, 4  # bytes: compute and serving dtype; master weights, optimizer state, reduction


@dataclass(frozen=True)
class Measurement:
    """A learner's peak device memory measured on a GPU (`torch.cuda.max_memory_allocated`)."""

    where: str
    shape: Qwen3Shape
    ranks: int
    sequences: int  # rows per micro-batch
    row_tokens: int  # tokens of each row (prompt + response)
    peak: float  # bytes


# docs/performance.md, "GPU mode: 1 x NVIDIA H200, learner alone": three M2PO updates of the 8B
# recipe's learner (bf16 over fp32 master weights, full activation checkpointing) on Qwen3-8B's
# shapes with 4 of its 36 layers (untied head), one rank, micro-batches of 4 rows of 64 + 512 tokens.
MEASURED = Measurement(
    "1 x H200, Qwen3-8B shapes with 4 layers", replace(QWEN3_8B, num_layers=4), 1, 4, 64 + 512, 42.3 * GB
)

# The moments of a micro-batch's backward that can set the learner's peak, and what each holds
# besides the sharded state (`learner_peak`).
PEAK_PHASES = {
    "a block's backward": "kept layer inputs, the root gathered, the head's gradient, one layer recomputed",
    "the head's backward": "kept layer inputs, the root gathered, the head's gradient and one chunk's",
    "the root's reduce-scatter": "the root's gradients whole in fp32",
}


@dataclass(frozen=True)
class Sizes:
    """Parameter counts by part, from the built model."""

    total: int
    layer: int
    root: int  # FSDP2's root unit: every parameter outside the blocks (embedding, final norm, lm head)
    head: int  # the lm head's weight (the embedding's, when tied)
    largest: int  # elements of the largest single tensor (the push gathers one at a time)
    num_layers: int


def model_sizes(shape: Qwen3Shape) -> Sizes:
    with tempfile.TemporaryDirectory() as tmp:
        arch = load_arch(write_qwen3_config(Path(tmp), shape))
        with torch.device("meta"):
            model = arch.build()
    numels = {name: p.numel() for name, p in model.named_parameters()}  # a tied weight once
    layer = sum(n for name, n in numels.items() if name.startswith("layers.0."))
    total, num_layers = sum(numels.values()), len(model.layers)
    root = total - num_layers * layer
    return Sizes(total, layer, root, model.lm_head.weight.numel(), max(numels.values()), num_layers)


def learner_peak(
    s: Sizes, shape: Qwen3Shape, tokens: int, ranks: int, checkpointing: str
) -> tuple[float, float, str]:
    """One rank's learner in a training step, in bytes: what stays between updates, the peak, and the
    phase of the step that sets the peak (`PEAK_PHASES`). `tokens`: one micro-batch's, padded."""
    d, hd = shape.hidden_size, shape.head_dim
    heads, kv_heads, mlp = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    master, adam, grads = FP32 * s.total / ranks, 2 * FP32 * s.total / ranks, FP32 * s.total / ranks
    per_token_layer = 4 * d + (heads + 2 * kv_heads) * hd + heads * hd + 3 * mlp  # values saved for backward
    if checkpointing == "full":
        kept = s.num_layers * tokens * d * BF16  # each layer's input
        recompute = 2 * tokens * per_token_layer * BF16  # one layer's activations and their gradients
    else:
        kept, recompute = s.num_layers * tokens * per_token_layer * BF16, tokens * per_token_layer * BF16
    # FSDP2: this and the prefetched layer gathered in bf16, and their fp32 gradients.
    gathered = 2 * s.layer * BF16 + 2 * s.layer * FP32
    # The root unit's parameters (embedding, final norm, lm head) gathered in bf16: FSDP2 leaves the
    # root unsharded after its forward (reshard_after_forward is None: False for the root), so they
    # stay from the embedding's forward to the end of the backward, beside the blocks' gathered ones.
    root_gathered = s.root * BF16
    # The lm head's whole bf16 gradient, from the head's backward to the end of the backward: the
    # root's inputs (token ids) carry no grad, so FSDP2 reduce-scatters its gradients only in the
    # backward's final callback, after every block's.
    head_grad = s.head * BF16
    h_dh = 2 * tokens * d * BF16  # the final norm's output and its gradient
    # One chunk's logits in bf16, their fp32 copy, the log-softmax and its gradient.
    chunk = chunk_size(shape.vocab_size) * shape.vocab_size * (BF16 + 3 * FP32)
    # The root's reduce-scatter (`foreach_reduce`): its gradients copied whole into one fp32 input
    # buffer; then the bf16 gradients are freed and the fp32 output (a 1/ranks shard) is allocated.
    root_reduce = s.root * FP32 + max(s.root * BF16, s.root * FP32 / ranks)
    phases = {  # what each holds besides the state (`PEAK_PHASES`), bytes
        "a block's backward": kept + root_gathered + head_grad + recompute + gathered,
        # Checkpointed chunks: each one's head gradient is added to the accumulated one.
        "the head's backward": kept + root_gathered + 2 * head_grad + h_dh + chunk,
        "the root's reduce-scatter": root_reduce,  # the blocks' inputs and parameters freed by then
    }
    phase = max(phases, key=phases.get)
    return master + adam, master + adam + grads + phases[phase], phase


def measured_check(m: Measurement = MEASURED) -> tuple[float, str]:
    """The predicted peak of `m`'s run, in bytes, and its phase."""
    _, peak, phase = learner_peak(model_sizes(m.shape), m.shape, m.sequences * m.row_tokens, m.ranks, "full")
    return peak, phase


def budget(recipe: Recipe, shape: Qwen3Shape, ranks: int, gpu: float) -> tuple[list[tuple], dict]:
    """(phase, what is resident, bytes in use, bytes in use without the release) rows, and figures."""
    s = model_sizes(shape)
    d, hd, vocab = shape.hidden_size, shape.head_dim, shape.vocab_size
    heads, kv_heads, mlp = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    # Learner, per rank.
    tokens = recipe.train.micro_batch_sequences * (
        recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens
    )
    learner_kept, peak, peak_phase = learner_peak(
        s, shape, tokens, ranks, recipe.train.activation_checkpointing
    )
    cached = peak - learner_kept  # what the allocator holds after an update unless released
    # Engine, per rank (tensor_parallel_size 1).
    weights = BF16 * s.total
    activation = (
        ENGINE_BATCHED_TOKENS * (3 * mlp + (heads + 2 * kv_heads) * hd + 2 * d) * BF16
        + ENGINE_MAX_SEQS * vocab * 4 * 3  # sampler: fp32 logits, softmax, processed logprobs
    )
    engine_share = recipe.rollout.gpu_memory_utilization * gpu
    kv = engine_share - weights - activation - CUDA_GRAPHS
    push = s.largest * (FP32 + BF16)  # the largest tensor gathered in fp32, and its cast
    base = CONTEXT_AND_NCCL + CUDA_GRAPHS  # the process, and the engine asleep (level 2)
    master = FP32 * s.total / ranks
    rows = [
        (
            "engine start",
            "context, learner's fp32 shards (AdamW state comes at the first update)",
            CONTEXT_AND_NCCL + master,
            CONTEXT_AND_NCCL + master,
        ),
        (
            "train, engine asleep (peak)",
            f"learner state, gradients; in {peak_phase}: {PEAK_PHASES[peak_phase]}",
            base + peak,
            base + peak,
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
        learner_peak=peak,
        peak_phase=peak_phase,
        tokens=tokens,
        kv=kv,
        kv_tokens=kv / (2 * s.num_layers * kv_heads * hd * BF16),
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
    m, (predicted, phase) = MEASURED, measured_check()
    print(
        f"Learner's training peak, measured on {m.where} ({m.ranks} rank, micro-batch {m.sequences} x "
        f"{m.row_tokens} tokens): measured {m.peak / GB:.1f} GB, predicted {predicted / GB:.1f} GB (in "
        f"{phase}), error {100 * (predicted - m.peak) / m.peak:+.1f}%"
    )
    train = next(used for name, _, used, _ in rows if name.startswith("train"))
    print(
        f"Learner's training peak here: {f['learner_peak'] / GB:.1f} GB (in {f['peak_phase']}); "
        f"{train / GB:.1f} GB with the context and the asleep engine, {(gpu - train) / GB:.1f} GB free "
        f"of {args.gpu_gb:g} GB"
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
