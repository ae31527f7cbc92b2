"""The GPU check: the colocated learner + engine on one device, measured end to end; prints a table.

On a GPU it builds a Qwen3-0.6B-shaped model locally (random weights, no hub) and measures, in order:
1. learner tokens/s and MFU of one optimizer update (fwd + bwd + AdamW), engine awake;
2. vLLM generation tokens/s (64 prompts x 8 samples x 256 tokens);
3. the same update with the engine asleep: peak device memory of both train phases;
4. weight sync: seconds for the bytes pushed, against the device's measured copy bandwidth;
5. engine-vs-learner logprob mismatch after that sync (bf16 on both sides);
6. a few M2PO updates on the engine's own samples: the loss must be finite and change.
On a CPU (no GPU found) the same steps run at tiny size; MFU and sleep mode need a GPU and are
reported as skipped. Exits 1 if a check fails (non-finite or constant loss, a CPU-mode mismatch
over 1e-4, a GPU-mode mismatch over 0.05).

    .venv/bin/python bench/gpu_check.py [--out DIR]    (scripts/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from local_model import QWEN3_0_6B, TINY, Qwen3Shape, write_qwen3

from m2po_cli.batch import Batch
from m2po_cli.config import load_recipe
from m2po_cli.device import resolve_dtype
from m2po_cli.learner import Learner
from m2po_cli.loss import build_loss
from m2po_cli.rollout.engine import VLLMEngine

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"
# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device-name substring.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
ON_GPU = torch.cuda.is_available()


class Check:
    """Rows of the table, the skipped items and the failed checks."""

    def __init__(self):
        self.rows: list[tuple[str, str]] = []
        self.skipped: list[str] = []
        self.failed: list[str] = []

    def row(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"  {name}: {value}", flush=True)

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def print(self) -> None:
        width = max(len(n) for n, _ in self.rows)
        print("\n" + "-" * (width + 40))
        for name, value in self.rows:
            print(f"{name:<{width}}  {value}")
        for item in self.skipped:
            print(f"skipped: {item}")
        print("-" * (width + 40))
        print("FAILED: " + "; ".join(self.failed) if self.failed else "all checks passed")


def synthetic_batch(num_rows: int, length: int, vocab: int, seed: int) -> Batch:
    """Full-length rows, the second half of each a 'response' with random advantages."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (num_rows, length), generator=g)
    mask = torch.zeros(num_rows, length)
    mask[:, length // 2 :] = 1.0
    return Batch(
        tokens_BL=tokens,
        mask_BL=mask,
        behaviour_logprobs_BL=torch.zeros(num_rows, length),  # refilled from the learner below
        advantages_B=torch.randn(num_rows, generator=g),
        lengths_B=torch.full((num_rows,), length),
    )


def device_bytes_in_use() -> int:
    if not ON_GPU:
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def timed_update(learner: Learner, batch: Batch, loss_fn) -> tuple[float, dict[str, float], int]:
    """Seconds, metrics and peak device bytes (whole device) of one optimizer update."""
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = device_bytes_in_use() - torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    metrics = learner.update(batch, loss_fn, int(batch.mask_BL.sum()))
    if ON_GPU:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = base + torch.cuda.max_memory_allocated() if ON_GPU else 0
    return seconds, metrics, peak


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (GPU) or 256 MiB (CPU), read + write counted once."""
    n = (2**30 if ON_GPU else 2**28) // 4
    device = "cuda" if ON_GPU else "cpu"
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        if ON_GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if ON_GPU:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the model (default: a temp dir)")
    args = ap.parse_args()
    shape: Qwen3Shape = QWEN3_0_6B if ON_GPU else TINY
    rows, length = (8, 2048) if ON_GPU else (4, 48)
    gen_prompts, gen_n, gen_tokens = (64, 8, 256) if ON_GPU else (4, 2, 16)
    check = Check()
    name = torch.cuda.get_device_name() if ON_GPU else "CPU"
    print(f"m2po gpu check on {name} ({'GPU' if ON_GPU else 'CPU'} mode)", flush=True)
    if not ON_GPU:
        check.skipped += [
            "Qwen3-0.6B size (CPU mode runs a 0.14M-parameter Qwen3 of the same layout)",
            "MFU (no peak-FLOPs figure for a CPU)",
            "sleep mode (vLLM has none on CPU: both train phases run with the engine awake)",
            "device memory figures (a CPU has no separate device memory)",
        ]
    with tempfile.TemporaryDirectory(prefix="m2po-gpu-check-") as tmp:
        out = args.out or Path(tmp)
        t0 = time.perf_counter()
        model_dir = write_qwen3(out / "model", shape)
        check.row(
            "model",
            f"Qwen3 {shape.num_params() / 1e6:.1f}M params, built in {time.perf_counter() - t0:.0f} s",
        )
        recipe = load_recipe(
            QUICKSTART,
            [
                f'model.path="{model_dir}"',
                f'run.output_dir="{out}"',
                'model.dtype="auto"',
                f"train.micro_batch_sequences={2 if ON_GPU else rows}",
                'loss={type="m2po", tau=0.04}',
                "optim.lr=1e-5" if ON_GPU else "optim.lr=0.02",
                f"rollout.n={gen_n}",
                "rollout.temperature=1.0",
                f"rollout.max_new_tokens={gen_tokens}",
                "rollout.gpu_memory_utilization=0.35",
                "rollout.sleep_level=1",
            ],
        )
        run_checks(check, recipe, model_dir, shape, rows, length, gen_prompts)
    check.print()
    return 1 if check.failed else 0


def run_checks(
    check: Check, recipe, model_dir: Path, shape: Qwen3Shape, rows: int, length: int, gen_prompts: int
):
    learner = Learner(model_dir, recipe)
    dtype = resolve_dtype(recipe.model.dtype)
    engine = VLLMEngine(model_dir, recipe.rollout, dtype, 512 if ON_GPU else 128, log=print)
    loss_fn = build_loss(recipe.loss)
    try:
        batch = synthetic_batch(rows, length, shape.vocab_size, seed=0)
        batch.behaviour_logprobs_BL = learner.score(batch)[0] * batch.mask_BL
        timed_update(learner, batch, loss_fn)  # warm-up: allocator, kernels
        seconds, _, peak_awake = timed_update(learner, batch, loss_fn)
        tokens_per_s = rows * length / seconds
        check.row(
            "learner tokens/s (fwd+bwd+AdamW)",
            f"{tokens_per_s:,.0f} ({rows} x {length} tokens, {seconds:.2f} s)",
        )
        peak = (
            next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
            if ON_GPU
            else None
        )
        if peak is not None:
            mfu = 6 * shape.num_params() * tokens_per_s / (peak * 1e12)
            check.row("learner MFU (6N FLOPs/token, bf16 peak)", f"{100 * mfu:.1f}% of {peak:.0f} TFLOP/s")
        elif ON_GPU:
            check.skipped.append(f"MFU (no bf16 peak figure for {torch.cuda.get_device_name()})")

        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)
        prompts = [torch.randint(5, shape.vocab_size, (16,)).tolist() for _ in range(gen_prompts)]
        t0 = time.perf_counter()
        groups = engine.generate(prompts, seed=0)
        gen_s = time.perf_counter() - t0
        num_generated = sum(len(c.token_ids) for g in groups for c in g)
        check.row(
            "vLLM generation tokens/s",
            f"{num_generated / gen_s:,.0f} ({num_generated:,} tokens, {gen_s:.1f} s)",
        )
        if ON_GPU:
            check.row("peak memory, generate (engine awake)", gib(device_bytes_in_use()))
            check.row("peak memory, train (engine awake)", gib(peak_awake))

        engine.sleep()
        _, _, peak_asleep = timed_update(learner, batch, loss_fn)
        if ON_GPU:
            check.row("peak memory, train (engine asleep)", gib(peak_asleep))

        bandwidth = copy_bandwidth()
        num_bytes = sum(t.numel() * t.element_size() for _, t in learner.hf_weights(engine.dtype))
        if ON_GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)  # wakes the engine
        sync_s = time.perf_counter() - t0
        check.row(
            "weight sync",
            f"{sync_s:.3f} s for {num_bytes / 1e6:,.1f} MB = {num_bytes / sync_s / 1e9:.2f} GB/s "
            f"(device copy {bandwidth / 1e9:.0f} GB/s: {sync_s / (num_bytes / bandwidth):.1f}x)",
        )
        engine.require_version(learner.version)

        probe = [p + g[0].token_ids for p, g in zip(prompts[:8], groups[:8], strict=True)]
        gap = probe_gap(engine, learner, probe)
        limit = 0.05 if ON_GPU else 1e-4
        check.row("logprob mismatch after sync (max |engine - learner|)", f"{gap:.2e} (limit {limit:g})")
        check.require(gap < limit, f"logprob mismatch {gap:.2e} >= {limit:g}")

        losses = m2po_steps(engine, learner, loss_fn, prompts[:8], num_steps=3)
        check.row("M2PO updates: loss", ", ".join(f"{x:.4g}" for x in losses))
        check.require(all(math.isfinite(x) for x in losses), "non-finite M2PO loss")
        check.require(len(set(losses)) > 1, "the M2PO loss did not change")
    finally:
        engine.close()


def probe_gap(engine: VLLMEngine, learner: Learner, sequences: list[list[int]]) -> float:
    """Largest |engine - learner| logprob of any token after the first of `sequences`."""
    from_engine = engine.prompt_logprobs(sequences)
    batch = padded(sequences, [[0.0] + lp for lp in from_engine], torch.zeros(len(sequences)), start=1)
    learner_BL, _ = learner.score(batch)
    return float(((learner_BL - batch.behaviour_logprobs_BL).abs() * batch.mask_BL).max())


def padded(
    sequences: list[list[int]],
    logprobs: list[list[float]],
    advantages_B: torch.Tensor,
    start: list[int] | int,
) -> Batch:
    """Right-padded rows; the mask (and the given behaviour logprobs) cover tokens from `start` on."""
    starts = [start] * len(sequences) if isinstance(start, int) else start
    length = max(len(s) for s in sequences)
    tokens, mask, behaviour = (torch.zeros(len(sequences), length) for _ in range(3))
    for i, (seq, lp, s) in enumerate(zip(sequences, logprobs, starts, strict=True)):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.float32)
        mask[i, s : len(seq)] = 1.0
        behaviour[i, s : len(seq)] = torch.tensor(lp[s:])
    return Batch(tokens.long(), mask, behaviour, advantages_B, torch.tensor([len(s) for s in sequences]))


def m2po_steps(
    engine: VLLMEngine, learner: Learner, loss_fn, prompts: list[list[int]], num_steps: int
) -> list[float]:
    """Sample, reward at random (seeded), one M2PO update, push: `num_steps` times; the losses."""
    losses = []
    g = torch.Generator().manual_seed(0)
    for step in range(num_steps):
        groups = engine.generate(prompts, seed=step)
        samples = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
        rewards_PG = torch.randint(0, 2, (len(prompts), len(groups[0])), generator=g).float()
        advantages_B = (
            (rewards_PG - rewards_PG.mean(1, keepdim=True)) / (rewards_PG.std(1, keepdim=True) + 1e-6)
        ).flatten()
        batch = padded(
            [p + c.token_ids for p, c in samples],
            [[0.0] * len(p) + c.logprobs for p, c in samples],
            advantages_B,
            start=[len(p) for p, _ in samples],
        )
        engine.sleep()
        metrics = learner.update(batch, loss_fn, int(batch.mask_BL.sum()))
        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)
        losses.append(metrics["loss/loss"])
    return losses


if __name__ == "__main__":
    sys.exit(main())
