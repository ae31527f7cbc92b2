"""The recipe's `[rollout]`, `[staleness]` and `[reuse]` tables: how rollouts are generated, how
stale they may be, and how often each is trained. `EngineTable` is shared with eval's `[engine]`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from m2po_cli.config.tables import Table, field


class EngineTable(Table):
    """One vLLM engine's keys, shared by a recipe's `[rollout]` and an eval's `[engine]`;
    `rollout.settings.engine_args` turns them into vLLM's arguments."""

    tensor_parallel_size: int = field(
        1,
        "GPUs per engine (tensor parallel). Colocated rollouts: ranks that share one engine, each group "
        "generating its own share; separate mode: GPUs per started engine.",
        ge=1,
    )
    cuda_graphs: bool = field(
        True,
        "GPU: capture CUDA graphs for decoding (slower start, faster generation; their memory counts in "
        "gpu_memory_utilization). The CPU runs eager.",
    )
    kv_cache_gib: float = field(1.0, "KV cache size per engine on CPU, in GiB.", gt=0)
    gpu_memory_utilization: float = field(
        0.5, "Fraction of GPU memory the engine may take (GPU only; the learner shares it).", gt=0, lt=1
    )


class RolloutConfig(EngineTable):
    engine: Literal["vllm"] = field("vllm", "Rollout engine.")
    mode: Literal["colocated", "separate"] = field(
        "colocated",
        "colocated: the engine shares the learner's devices and the two alternate; separate: engines in "
        "their own processes keep generating while the learner trains, with staleness bounded by staleness.max_staleness.",
    )
    servers: list[str] = field(
        [], "Separate mode: URLs of `vllm serve` instances already running; empty starts num_engines here."
    )
    num_engines: int = field(
        1,
        "Separate mode: `vllm serve` processes the run starts, on rank 0's node; on GPUs, each takes "
        "tensor_parallel_size GPUs after those of the node's learner ranks.",
        ge=1,
    )
    weight_transport: Literal["auto", "nccl", "shm"] = field(
        "auto",
        "Separate mode: how weights reach the engines. nccl: vLLM's NCCL weight-transfer engine (GPUs); "
        "shm: safetensors in shared memory, reloaded by each engine (same host; the CPU's choice); "
        "auto: nccl where CUDA is available, else shm.",
    )
    sync_every: int = field(
        1,
        "Separate mode: send the weights to the engines every this many updates. A sync pauses the "
        "engines and makes them recompute the KV cache of their requests in flight; the engines' "
        "weights lag the learner's by up to sync_every - 1 updates (docs/staleness.md).",
        ge=1,
    )
    server_start_timeout_s: float = field(
        600.0, "Separate mode: seconds a started server may take to answer /health.", gt=0
    )
    attach_wait_s: float = field(
        0.0,
        "Separate mode, rollout.servers: seconds to wait for each server to answer /health before it is "
        "checked (engines a job script starts beside the run); 0 checks at once.",
        ge=0,
    )
    transport_address: str = field(
        "",
        "Separate mode, nccl transport: the address of learner rank 0 that every engine host can reach "
        "(the NCCL rendezvous); empty: loopback when every server is local, else this host's address.",
    )
    rendezvous_timeout_s: float = field(
        60.0,
        "Separate mode, nccl transport: seconds each engine has to reach the rendezvous before the "
        "first sync; one that does not stops the run, named.",
        gt=0,
    )
    sync_timeout_s: float = field(
        300.0,
        "Separate mode: seconds one weight sync may take. An engine the run started that exits during a "
        "sync, or a sync that outlasts this, ends the run in one line naming the engine (a NCCL sync "
        "would otherwise wait for run.collective_timeout_minutes).",
        gt=0,
    )
    request_timeout_s: float = field(
        1800.0,
        "Separate mode: seconds one rollout request may take, and the longest the learner waits with no "
        "group finishing, before the run stops naming the server; must be below run.collective_timeout_minutes.",
        gt=0,
    )
    push_check_tolerance: float = field(
        0.05,
        "After every weight push, the engine samples a few tokens of a fixed probe and the learner scores "
        "them: a mean |logprob difference| above this stops the run (the engine is not sampling the "
        "policy it was sent, e.g. an adapter it did not apply).",
        gt=0,
    )
    prompts_per_step: int = field(32, "Prompts per rollout batch.", ge=1)
    n: int = field(8, "Samples per prompt (the GRPO group size).", ge=1)
    max_new_tokens: int = field(2560, "Longest response, in tokens.", ge=1)
    temperature: float = field(1.0, "Sampling temperature; logprobs are taken at this temperature.", gt=0)
    top_p: float = field(
        1.0, "Nucleus sampling; must stay 1.0 for training, or the importance ratio is biased.", gt=0, le=1
    )
    sleep_level: Literal[0, 1, 2] = field(
        2,
        "GPU: vLLM sleep level while the learner trains (0: stay awake; 2: weights and KV cache freed, "
        "the learner's weights pushed after the wake). Level 1 is refused: it keeps a pinned host copy "
        "of the weights that the push overwrites. The CPU has no sleep mode.",
    )

    def launch_problem(self, world: int, local_world: int | None = None) -> str | None:
        """What keeps a launch of `world` processes, `local_world` of them on each node (None: all on
        one), from running this rollout, or None. Colocated engines span `tensor_parallel_size`
        consecutive ranks, so it must divide them, and divide a node's: an engine whose ranks sit on
        two nodes would run its tensor parallelism over the network, which vLLM's in-process launcher
        does not support well."""
        tp = self.tensor_parallel_size
        if self.mode != "colocated":
            return None
        if world % tp:
            return (
                f"rollout.tensor_parallel_size: {tp} does not divide the {world} process(es) of this "
                "launch; start a multiple of it (torchrun --nproc-per-node)"
            )
        local = world if local_world is None else local_world
        if local % tp:
            return (
                f"rollout.tensor_parallel_size: {tp} does not divide the {local} process(es) on each node, "
                "so an engine would span two nodes; keep each engine within a node (a multiple of it "
                "per node: torchrun --nproc-per-node)"
            )
        return None

    @model_validator(mode="after")
    def _check_sleep_level(self) -> RolloutConfig:
        if self.sleep_level == 1:
            raise ValueError(
                "sleep_level: 1 keeps a pinned host copy of the engine's weights (16 GB a GPU for an 8B "
                "model) that every push overwrites; use 2 (the learner's weights are pushed after the "
                "wake) or 0 (stay awake)"
            )
        return self

    @model_validator(mode="after")
    def _check_top_p(self) -> RolloutConfig:
        if self.top_p != 1.0:
            raise ValueError(
                "top_p: must be 1.0 for training rollouts (truncated sampling biases the importance ratio) "
                f"(got {self.top_p})"
            )
        return self


class StalenessConfig(Table):
    """How stale the trained rollouts are, by the rollout mode: colocated, every batch is trained
    exactly `s` updates after the policy that generated it (fixed); separate, no sample is trained
    more than `max_staleness` updates after its policy (bounded)."""

    s: int = field(0, "Colocated rollouts: staleness in optimizer updates; 0 is on-policy.", ge=0)
    max_staleness: int = field(4, "Separate rollouts: largest staleness, in optimizer updates.", ge=0)

    @model_validator(mode="before")
    @classmethod
    def _no_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mode" in data:
            raise ValueError(
                "mode: follows rollout.mode (fixed at s when colocated, bounded by max_staleness when "
                "separate); remove the line"
            )
        return data


class ReuseConfig(Table):
    """Training on each rollout more than once. `epochs`: every rollout batch is trained `epochs`
    times over, one mini-batch after another (TRL's `num_iterations`, verl's `ppo_epochs`).
    `replay`: the learner keeps the last `buffer` rollout batches it trained, and every update trains
    its fresh groups plus `replay` times as many groups drawn from them by `rule`, none older than
    `max_age` updates. Every token keeps the behaviour logprob and the version that sampled it, so its
    importance ratio is exact and the loss decides what it contributes; a group is replayed whole."""

    mode: Literal["off", "epochs", "replay"] = field("off", "off, epochs or replay.")
    epochs: int = field(2, "epochs: passes over every rollout batch.", ge=1)
    buffer: int = field(4, "replay: rollout batches the buffer holds, the newest.", ge=1)
    replay: float = field(
        1.0, "replay: groups replayed per update, as a multiple of the update's fresh groups.", gt=0
    )
    rule: Literal["uniform", "freshest", "advantage"] = field(
        "uniform",
        "replay: how an update draws its groups: uniform (at random), freshest (the newest policy "
        "versions first), advantage (at random, in proportion to the group's mean |advantage|; groups "
        "whose rewards are all equal carry no gradient and are never drawn).",
    )
    max_age: int = field(
        32,
        "replay: the most updates between a replayed group's policy version and the update that trains it.",
        ge=1,
    )

    @model_validator(mode="after")
    def _check_epochs(self) -> ReuseConfig:
        if self.mode == "epochs" and self.epochs < 2:
            raise ValueError(f"epochs: must be >= 2 in epochs mode; 1 is mode = off (got {self.epochs})")
        return self

    @property
    def epochs_per_batch(self) -> int:
        """Passes over each rollout batch: `epochs` in epochs mode, else 1."""
        return self.epochs if self.mode == "epochs" else 1
