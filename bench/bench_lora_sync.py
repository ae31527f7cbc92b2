"""A LoRA weight sync against a full one: bytes and seconds per push into the running vLLM engine.

Builds a random Qwen3 (`local_model.CPU_BENCH`, ~40M parameters) and, in the same run, two one-rank
FSDP2 learners with an in-process engine each: one trained in full, one with a rank-16 adapter on
the seven projections (`[lora]` defaults). Each repeat times, back to back on both:
- push: what the colocated loop runs after a step's updates (`Pusher.payload` + `engine.push`): the
  full weights gathered and loaded in place, or the adapter gathered, written as a PEFT folder and
  loaded by the engine under its version's name;
- check: the push check (`Pusher.check`: one prefill of the probe in the engine, the learner scores
  the 16 most likely next tokens).
Prints medians and the full / LoRA ratios of bytes and seconds.

    .venv/bin/python bench/bench_lora_sync.py [--repeats 5] [--rank 16]

At the 8B recipe's sizes (Qwen3-8B: 36 layers, hidden 4096, MLP 12,288, 32/8 heads of 128; the
seven projections of a layer hold 75,776 x r adapter parameters): 2,727,936 x r in all, so a sync
carries 87.3 MB at r = 16 and 349 MB at r = 64 in bf16, against 16.38 GB of full weights (188x and
47x fewer bytes). `lora_arithmetic` prints it from the shapes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from local_model import CPU_BENCH, QWEN3_8B, write_qwen3

from m2po_cli.config import load_recipe
from m2po_cli.learner.policy import Learner
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.train.push import Pusher

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"


def lora_arithmetic(shape, rank: int, bytes_per_param: int = 2) -> tuple[float, float]:
    """(adapter bytes, full-weight bytes) of one sync of `shape` with adapters of `rank` on q, k, v,
    o, gate, up and down (each adds r x (in + out) parameters)."""
    d, h = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * h, shape.num_kv_heads * h
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 3 * (d + shape.intermediate_size)
    return shape.num_layers * per_layer * rank * bytes_per_param, shape.num_params() * bytes_per_param


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="m2po-bench-") as tmp:
        model_dir = write_qwen3(Path(tmp) / "model", CPU_BENCH)
        sides = {}
        for name, more in (("full", []), ("lora", [f"lora.rank={args.rank}"])):
            run = Path(tmp) / name
            sets = [f'model.path="{model_dir}"', f'run.output_dir="{run}"', *more]
            recipe = load_recipe(QUICKSTART, sets)
            learner = Learner(model_dir, recipe)
            engine = VLLMEngine(model_dir, recipe.rollout, "float32", 128, lora_rank=recipe.lora.rank)
            sides[name] = (
                learner,
                engine,
                Pusher(learner, engine, run, str(model_dir), len(engine.tokenizer)),
            )
        try:
            runs = []
            for repeat in range(args.repeats):
                row = {}
                for name, (learner, engine, pusher) in sides.items():
                    learner.version = repeat + 1
                    payload = None

                    def push(pusher=pusher, engine=engine):
                        nonlocal payload
                        payload = pusher.payload()
                        engine.push(payload)

                    row[f"{name}_push"] = timed(push)
                    row[f"{name}_check"] = timed(lambda p=pusher, pl=payload: p.check(pl))
                    assert pusher.mismatch < 1e-4, (name, pusher.mismatch)
                runs.append(row)
            full_bytes = sum(
                t.numel() * t.element_size() for _, t in sides["full"][0].hf_weights(torch.float32)
            )
            lora_bytes = sum(
                t.numel() * t.element_size() for _, t in sides["lora"][0].adapter_tensors(torch.float32)
            )
        finally:
            for _, engine, pusher in sides.values():
                pusher.close()
                engine.close()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = statistics.median(r["full_push"] / r["lora_push"] for r in runs)
    print(
        f"model: {CPU_BENCH.num_params() / 1e6:.1f}M parameters (fp32); adapter rank {args.rank} on 7 projections"
    )
    print(f"median of {args.repeats} interleaved repeats")
    print(
        f"bytes per push      full {full_bytes / 1e6:8.1f} MB   lora {lora_bytes / 1e6:7.2f} MB   {full_bytes / lora_bytes:6.1f}x"
    )
    print(
        f"seconds per push    full {med['full_push']:8.3f} s    lora {med['lora_push']:7.3f} s    {ratio:6.1f}x"
    )
    print(f"push check          full {med['full_check']:8.3f} s    lora {med['lora_check']:7.3f} s")
    for rank in (16, 64):
        adapter, full = lora_arithmetic(QWEN3_8B, rank)
        print(
            f"Qwen3-8B, bf16, r = {rank}: {adapter / 1e6:.1f} MB per sync against {full / 1e9:.2f} GB ({full / adapter:.0f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
