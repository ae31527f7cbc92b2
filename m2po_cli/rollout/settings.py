"""The settings every vLLM engine of the project takes: the in-process one of each rank (and of
`m2po eval`) and `vllm serve` alike, written once here.

`engine_args` are vLLM's engine arguments by their Python names; `vllm.LLM` takes them as keywords
and `cli_flags` spells them as `vllm serve` flags. `rollout_sampling` is the sampling of every
rollout, `is_finished` what counts as a response that ended by itself.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from m2po_cli.config import EngineTable, RolloutConfig

# vLLM imports the worker extension by name in every worker process (`rollout/worker.py`).
WORKER_EXTENSION = "m2po_cli.rollout.worker.WeightSync"
# The adapter ranks vLLM allocates for (`--max-lora-rank` takes one of them).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapter slots on the device (each holds one adapter at --max-lora-rank: 87 MB at Qwen3-8B, r 16).
MAX_DEVICE_LORAS = 8
# Tokens a CPU engine step may take (vLLM's own CPU default), raised to the longest sequence.
CPU_BATCHED_TOKENS = 4096


def engine_args(
    model_dir: Path,
    engine: EngineTable,
    *,
    dtype: str,
    max_model_len: int,
    on_gpu: bool,
    behaviour_logprobs: bool,
    lora_rank: int = 0,
    lora_slots: int = 1,
) -> dict[str, Any]:
    """The engine arguments of one engine of `engine`'s keys. `behaviour_logprobs`: a rollout engine,
    whose sampled tokens' logprobs are the behaviour policy's. The KV cache is sized in bytes on the
    CPU, as a share of the device's memory on a GPU. `lora_rank` > 0: the engine serves adapters of
    that rank, `lora_slots` of them at once (`payload.lora_slots`)."""
    args: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=engine.tensor_parallel_size,
        enforce_eager=not (on_gpu and engine.cuda_graphs),  # CUDA graphs exist on a GPU only
        seed=0,
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=True,
    )
    if behaviour_logprobs:
        # Behaviour logprobs must be those of the distribution actually sampled (after temperature).
        args["logprobs_mode"] = "processed_logprobs"
    if lora_rank:
        # vLLM sizes its adapter buffers by max_lora_rank, which must be one of its supported ranks.
        args["enable_lora"] = True
        args["max_lora_rank"] = min(r for r in VLLM_LORA_RANKS if r >= lora_rank)
        # Adapters batched at once on the device; the others wait in host memory (`payload.lora_slots`).
        args["max_loras"] = min(lora_slots, MAX_DEVICE_LORAS)
        args["max_cpu_loras"] = lora_slots
        # The push check's probe goes ahead of the rollouts queued (at the default priority, 0, they
        # keep their arrival order): a sync does not wait for a batch of responses to finish.
        args["scheduling_policy"] = "priority"
    if on_gpu:
        args["gpu_memory_utilization"] = engine.gpu_memory_utilization
    else:
        args["kv_cache_memory_bytes"] = int(engine.kv_cache_gib * 2**30)
        # vLLM's CPU runner rolls a request's generator back after a partial prefill chunk, which a
        # CPU generator cannot do ("CPU Generator does not use offset"): with per-request seeds every
        # prompt is prefilled in one step, within a budget that holds the longest.
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(max_model_len, CPU_BATCHED_TOKENS)
    return args


def cli_flags(args: dict[str, Any]) -> list[str]:
    """`engine_args` as `vllm serve` flags: `--name value`, a bare `--name` for True, `--no-name` for
    False (vLLM's boolean flags take both forms; a False default would otherwise be lost)."""
    flags: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def cpu_threads(local_rank: int, local_world: int) -> dict[str, str]:
    """vLLM's CPU thread binding for one of `local_world` engines on this host: its share of the
    cores (binding doubles throughput here), none reserved."""
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // local_world)
    first = (local_rank * per_rank) % cores
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"{first}-{first + per_rank - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def request_seed(run_seed: int, *place: int) -> int:
    """The sampling seed of one prompt's request, from the run's seed and the request's place in the
    run (colocated: rollout step and prompt; separate: admission index).

    vLLM seeds each request's own generator with it (sample i of the prompt's `n` with seed + i), so
    the samples depend on these numbers alone, never on which other requests share the engine's
    batch, and on a GPU vLLM does not draw a fresh random seed for the request. A hash, so that the
    n consecutive seeds of different requests do not overlap: 62 bits, within vLLM's int64."""
    digest = hashlib.blake2b(repr((run_seed, *place)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def rollout_sampling(cfg: RolloutConfig, seed: int, max_tokens: int | None = None) -> dict[str, Any]:
    """One prompt's rollout sampling: `n` samples at the recipe's temperature from the untruncated
    distribution (no top-p, top-k or min-p, so behaviour logprobs are the full policy's), each
    sampled token's logprob returned, seeded per request (`request_seed`). An episode's later turn
    (`max_tokens` given) is one sample of at most that many tokens."""
    return dict(
        seed=seed,
        n=cfg.n if max_tokens is None else 1,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=cfg.max_new_tokens if max_tokens is None else max_tokens,
        logprobs=0,
    )


def is_finished(finish_reason: str | None) -> bool:
    """A response that ended by itself (EOS or a stop token), not cut at `max_tokens` or aborted."""
    return finish_reason == "stop"
