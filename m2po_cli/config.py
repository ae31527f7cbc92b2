"""Recipe schema: TOML tables parsed into typed, frozen models.

Precedence is defaults < recipe file < `--set key.path=value` overrides (the loader is
`tomlconf`, shared with the eval configs). Every field carries a one-line description; the same
text feeds `docs/recipes.md` and `--help`. This module imports
neither torch nor vllm, so `--dry-run` and validation errors are fast.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import model_validator

from m2po_cli.loss_config import LOSS_KEYS, AlgorithmConfig, LossConfig, M2POLoss
from m2po_cli.tomlconf import ConfigError as ConfigError  # noqa: F401  (re-exported)
from m2po_cli.tomlconf import Table, field, load

PAPER_PROMPT_TEMPLATE = (
    "Please solve the following math problem: {problem}. The assistant first thinks about the "
    "reasoning process step by step and then provides the user with the answer. Return the final "
    "answer in \\boxed{{}} tags, for example \\boxed{{1}}. Let's solve this step by step. "
)

BUILTIN_MODELS = (
    "builtin:tiny-qwen3",
    "builtin:tiny-qwen3-untied",
    "builtin:tiny-qwen3-long-tail",
    "builtin:smollm2-135m-instruct",
)
SYNTHETIC_SOURCES = ("synthetic:arithmetic",)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_template(template: str, key: str) -> None:
    """The prompt-template rule of recipes and eval configs: `template.format(problem=...)` must work
    with `problem` alone; literal braces are written `{{` and `}}`. Raises ValueError("key: ...")."""
    if "{problem}" not in template:
        raise ValueError(f"{key}: must contain {{problem}}")
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{key}: {e!r}; write literal braces as {{{{ and }}}}") from None


class RunConfig(Table):
    name: str = field("run", "Run name; the run directory is `<output_dir>/<name>`.", min_length=1)
    output_dir: str = field("runs", "Parent folder of run directories.")
    seed: int = field(0, "Seed for data order, sampling and initialisation.", ge=0)
    steps: int = field(100, "Training steps; each step trains on one rollout batch.", ge=1)
    collective_timeout_minutes: float = field(
        60.0,
        "How long a rank waits in a collective (gather, all-reduce) before the run fails; must exceed the "
        "longest wait for another rank: the slowest engine sampling and grading its share of a rollout "
        "batch, a checkpoint save, the final export.",
        gt=0,
    )


class ModelConfig(Table):
    path: str = field(
        ...,
        "Model: a local HF-format directory, a hub id (org/name), or a builtin "
        f"({', '.join(BUILTIN_MODELS)}) built offline and cached.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = field(
        "auto",
        "Dtype of rollouts and of the learner's matmuls (master weights stay float32); auto is float32 "
        "on CPU, bfloat16 on GPU. The HF export is bfloat16 only when this is bfloat16.",
    )

    @model_validator(mode="after")
    def _check_path(self) -> ModelConfig:
        try:
            model_source(self.path)
        except ValueError as e:
            raise ValueError(f"path: {e}") from None
        return self


def model_source(path: str) -> Literal["builtin", "local", "hub"]:
    """What a model path names: the one rule for recipes, `m2po eval` and `models.resolve_model`.

    A path that exists, starts like a path (`/`, `.`, `~`) or starts with an existing folder (`runs/x`)
    is local, never a hub id. Raises ValueError with a one-line reason.
    """
    if path.startswith("builtin:"):
        if path not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin {path!r}; choose one of {', '.join(BUILTIN_MODELS)}")
        return "builtin"
    local = Path(path).expanduser()
    if local.is_dir():
        return "local"
    if path.startswith(("/", ".", "~")) or local.exists():
        raise ValueError(f"model directory not found: {path}")
    if HUB_ID.match(path) and Path(local.parts[0]).is_dir():
        raise ValueError(f"model directory not found: {path} ({local.parts[0]}/ is a local folder)")
    if not HUB_ID.match(path):
        raise ValueError(f"{path!r} is neither an existing directory, a hub id (org/name) nor a builtin")
    return "hub"


class SyntheticConfig(Table):
    max_operand: int = field(9, "Largest operand of the synthetic arithmetic problems.", ge=1, le=10**6)
    num_operands: int = field(2, "Operands per synthetic problem (a + b + ...).", ge=1, le=8)
    num_problems: int = field(10_000, "Size of the synthetic prompt set.", ge=1)


class DataConfig(Table):
    source: str = field(
        ..., "Prompts: a local .jsonl/.json/.parquet file, a hub dataset id, or synthetic:arithmetic."
    )
    split: str = field("train", "Dataset split when `source` is a hub id.")
    prompt_key: str = field("problem", "Field holding the problem text.")
    answer_key: str = field("answer", "Field holding the ground-truth answer.")
    prompt_template: str = field(
        PAPER_PROMPT_TEMPLATE, "User-turn template; `{problem}` is replaced by the problem text."
    )
    shuffle_seed: int = field(42, "Seed of the one-off shuffle of the prompt set.", ge=0)
    max_prompt_tokens: int = field(
        1536, "Prompts longer than this (after the chat template) are dropped.", ge=1
    )
    synthetic: SyntheticConfig = field(SyntheticConfig(), "Options of the synthetic arithmetic task.")

    @model_validator(mode="after")
    def _check_source(self) -> DataConfig:
        s = self.source
        if s.startswith("synthetic:"):
            if s not in SYNTHETIC_SOURCES:
                raise ValueError(
                    f"source: unknown synthetic task {s!r}; choose one of {', '.join(SYNTHETIC_SOURCES)}"
                )
        elif s.endswith((".jsonl", ".json", ".parquet")):
            if not Path(s).expanduser().is_file():
                raise ValueError(f"source: file not found: {s}")
        elif not HUB_ID.match(s):
            raise ValueError(
                f"source: {s!r} is neither a .jsonl/.json/.parquet file, a hub id nor synthetic:arithmetic"
            )
        check_template(self.prompt_template, "prompt_template")
        return self


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
    num_engines: int = field(1, "Separate mode: `vllm serve` processes the run starts.", ge=1)
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
    request_timeout_s: float = field(
        1800.0,
        "Separate mode: seconds one rollout request may take, and the longest the learner waits with no "
        "group finishing, before the run stops naming the server; must be below run.collective_timeout_minutes.",
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


class RewardConfig(Table):
    function: str = field(
        "",
        "A Python reward, `package.module:name`, called once per group as name(prompt, completions, "
        "answer, **columns): the problem text, the n response texts, the gold answer and the row's "
        "other dataset fields; it returns one number per completion. It runs in the grader's worker "
        "processes within timeout_s (past it the group scores 0). Empty: the built-in math grader "
        "(what `m2po eval` always scores with).",
    )
    timeout_s: float = field(
        5.0,
        "Seconds one grading call may take before it scores 0: a response (math grader) or a group (function).",
        gt=0,
    )

    @model_validator(mode="after")
    def _check_function(self) -> RewardConfig:
        if self.function and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.function):
            raise ValueError(f"function: {self.function!r} is not `package.module:name`")
        return self


class TrainConfig(Table):
    mini_batch_prompts: int = field(
        0, "Prompts per optimizer update; 0 means the whole rollout batch (one update per step).", ge=0
    )
    micro_batch_sequences: int = field(64, "Sequences per forward/backward (gradient accumulation).", ge=1)
    micro_batch_tokens: int = field(
        0,
        "Token budget per forward/backward: rows sorted by length, a micro-batch padded to its longest "
        "row holds at most this many tokens (a longer row goes alone); 0: no budget.",
        ge=0,
    )
    global_pass: Literal["auto", "score_first", "correct_after"] = field(
        "auto",
        "How M2PO gets its mask over the whole batch: score_first, a no-grad pass before the training "
        "forwards; correct_after, from the training forwards under the previous update's threshold, "
        "then a correction over the tokens that mask got wrong; auto, from the training forward itself "
        "when every rank's rows are one micro-batch (no other pass), else the cheaper of the two by the "
        "last correction's size. All give the same update.",
    )
    share_prompts: Literal["auto", "on", "off"] = field(
        "auto",
        "Compute a group's prompt once for all its responses (one packed sequence; each response "
        "sees the prompt and itself): on, off, or auto, where that saves at least a quarter of the "
        "tokens and no packed group exceeds 8192 tokens (its attention mask).",
    )
    compile: bool = field(False, "torch.compile the model.")
    activation_checkpointing: Literal["none", "full"] = field("none", "Activation checkpointing mode.")


class ParallelConfig(Table):
    """How the learner's ranks hold the model. FSDP2 shards it over `dp_shard` consecutive ranks;
    `dp_replicate` such groups each hold a whole copy (HSDP): parameters are gathered within a group,
    and only the gradients cross between groups, once per optimizer update. Shard within a node and
    replicate across nodes, and the per-layer gathers never leave a node."""

    dp_replicate: int = field(
        1, "Replicas of the sharded model (HSDP); 1 shards over every rank (FSDP).", ge=1
    )
    dp_shard: int = field(
        -1,
        "Ranks each replica shards the model over; -1: every rank of a replica (WORLD_SIZE / dp_replicate).",
        ge=-1,
    )

    @model_validator(mode="after")
    def _check_shard(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard: must be >= 1, or -1 for every rank of a replica (got 0)")
        return self

    def degrees(self, world: int) -> tuple[int, int]:
        """(replicate, shard) for a launch of `world` processes; `launch_problem` must be None."""
        return self.dp_replicate, world // self.dp_replicate if self.dp_shard == -1 else self.dp_shard

    def launch_problem(self, world: int, local_world: int | None = None) -> str | None:
        """What keeps a launch of `world` processes, `local_world` on each node (None: all on one), from
        taking these degrees, or None. A shard group is `dp_shard` consecutive ranks, and torchrun
        numbers ranks node by node, so a group must hold whole nodes or a node whole groups."""
        replicate, shard = self.dp_replicate, self.dp_shard
        if shard == -1:
            if world % replicate:
                return (
                    f"parallel.dp_replicate: {replicate} does not divide the {world} process(es) of this "
                    "launch (WORLD_SIZE)"
                )
            shard = world // replicate
        elif replicate * shard != world:
            return (
                f"parallel: dp_replicate {replicate} x dp_shard {shard} = {replicate * shard} ranks, but this "
                f"launch has {world} process(es) (WORLD_SIZE)"
            )
        local = world if local_world is None else local_world
        if shard % local and local % shard:
            return (
                f"parallel.dp_shard: a shard group of {shard} ranks would split the {local} process(es) of a "
                f"node unevenly; use a divisor or a multiple of {local} (LOCAL_WORLD_SIZE)"
            )
        return None


class OptimConfig(Table):
    lr: float = field(1e-6, "AdamW learning rate.", gt=0)
    weight_decay: float = field(0.01, "AdamW weight decay.", ge=0)
    betas: tuple[float, float] = field((0.9, 0.999), "AdamW betas.")
    eps: float = field(1e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = field(1.0, "Clip the global gradient norm to this; 0 disables clipping.", ge=0)
    warmup_updates: int = field(0, "Linear warm-up length, in optimizer updates.", ge=0)
    schedule: Literal["constant", "cosine", "linear"] = field("constant", "LR schedule after warm-up.")

    @model_validator(mode="after")
    def _check_betas(self) -> OptimConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: each must be in [0, 1) (got {list(self.betas)})")
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


class CheckpointConfig(Table):
    every: int = field(0, "Save a DCP checkpoint every this many steps; 0: none on the way.", ge=0)
    final: bool = field(
        False,
        "Save one after the last step too; off by default: a finished run needs none to resume and the "
        "export holds its policy (a re-run with more steps resumes from the last periodic one).",
    )
    keep: int = field(2, "Checkpoints kept on disk (oldest removed first).", ge=1)
    resume: Literal["auto", "never"] = field(
        "auto", "auto: continue from the run directory's latest checkpoint."
    )
    export_hf: bool = field(True, "Export the final policy as HF safetensors to `<run>/export`.")


class InspectConfig(Table):
    every: int = field(
        50,
        "Record a sample of token-level data for `m2po inspect` every this many steps; 0 records none.",
        ge=0,
    )
    tokens: int = field(
        4096,
        "Response tokens recorded per update of a recorded step (whole sequences sampled at random, at "
        "least one); 0 records every sequence.",
        ge=0,
    )


class LoggingConfig(Table):
    wandb: bool = field(False, "Log metrics to Weights & Biases.")
    wandb_project: str = field("m2po", "W&B project.")
    wandb_mode: Literal["online", "offline"] = field(
        "offline", "offline writes a local run folder; `wandb sync` uploads it."
    )
    console: Literal["rich", "plain"] = field(
        "rich", "rich: live progress display; plain: one line per step."
    )
    samples: int = field(
        0,
        "Every samples_every steps, k responses of the batch just trained (prompt, completion, "
        "reward) go to samples.jsonl in the run directory; 0: none.",
        ge=0,
    )
    samples_every: int = field(10, "Steps between two sample tables (from step 0).", ge=1)
    samples_console: bool = field(False, "Show each sample table on the console too.")


class Recipe(Table):
    run: RunConfig = field(RunConfig(), "Run identity and length.")
    model: ModelConfig = field(..., "Policy model.")
    data: DataConfig = field(..., "Prompt set.")
    rollout: RolloutConfig = field(RolloutConfig(), "Rollout engine.")
    algorithm: AlgorithmConfig = field(AlgorithmConfig(), "Advantage estimation.")
    reward: RewardConfig = field(RewardConfig(), "What scores a response: the math grader or a function.")
    loss: LossConfig = field(M2POLoss(), "Policy loss; `type` selects the loss.")
    train: TrainConfig = field(TrainConfig(), "Batching of the learner.")
    parallel: ParallelConfig = field(
        ParallelConfig(), "How the learner's ranks shard and replicate the model."
    )
    optim: OptimConfig = field(OptimConfig(), "Optimizer and schedule.")
    staleness: StalenessConfig = field(StalenessConfig(), "Staleness injection.")
    reuse: ReuseConfig = field(ReuseConfig(), "Training on each rollout more than once.")
    checkpoint: CheckpointConfig = field(CheckpointConfig(), "Checkpoints and export.")
    logging: LoggingConfig = field(LoggingConfig(), "Metrics sinks.")
    inspect: InspectConfig = field(InspectConfig(), "Token-level records for `m2po inspect`.")

    @model_validator(mode="after")
    def _check_cross(self) -> Recipe:
        if self.algorithm.normalize_std and self.rollout.n == 1:
            raise ValueError("rollout.n: must be >= 2 when algorithm.normalize_std is true (got 1)")
        mb = self.train.mini_batch_prompts
        if mb and self.rollout.prompts_per_step % mb:
            raise ValueError(
                f"train.mini_batch_prompts: must divide rollout.prompts_per_step "
                f"({self.rollout.prompts_per_step}) (got {mb})"
            )
        self._check_separate()
        if self.staleness.s % self.updates_per_step:
            raise ValueError(
                f"staleness.s: must be a multiple of the {self.updates_per_step} optimizer updates "
                f"per rollout batch (got {self.staleness.s})"
            )
        return self

    def _check_separate(self) -> None:
        if not self.bounded_staleness:
            return
        if self.rollout.request_timeout_s >= 60 * self.run.collective_timeout_minutes:
            raise ValueError(
                f"rollout.request_timeout_s: must be below run.collective_timeout_minutes "
                f"({self.run.collective_timeout_minutes:g} min), or the other ranks time out before rank 0 "
                f"can say which server stopped answering (got {self.rollout.request_timeout_s:g} s)"
            )
        if self.algorithm.behaviour_logprobs != "engine":
            raise ValueError(
                "algorithm.behaviour_logprobs: must be engine in separate mode (the learner no longer holds "
                "the policy that generated a sample)"
            )
        # A step takes updates_per_step mini-batches at once, and the engine may lag sync_every - 1
        # updates: the bound must leave room for both, or admission would stall the run.
        need = self.updates_per_step - 1 + self.rollout.sync_every - 1
        if self.staleness.max_staleness < need:
            raise ValueError(
                f"staleness.max_staleness: must be >= updates_per_step - 1 + rollout.sync_every - 1 = {need} "
                f"(got {self.staleness.max_staleness})"
            )

    @property
    def prompts_per_update(self) -> int:
        """Prompts (groups) in one optimizer update: a mini-batch, or the whole rollout batch."""
        return self.train.mini_batch_prompts or self.rollout.prompts_per_step

    def launch_problem(self, world: int, local_world: int | None = None) -> str | None:
        """What keeps a launch of `world` processes, `local_world` on each node, from running this
        recipe (the engines' and the learner's layouts), or None. Cheap: checked before anything starts."""
        return self.rollout.launch_problem(world, local_world) or self.parallel.launch_problem(
            world, local_world
        )

    @property
    def mini_batches(self) -> int:
        """Optimizer updates per pass over a rollout batch."""
        return self.rollout.prompts_per_step // self.prompts_per_update

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per step: the mini-batches of every pass (`reuse.epochs` passes in epochs mode)."""
        return self.mini_batches * self.reuse.epochs_per_batch

    @property
    def max_model_len(self) -> int:
        """The longest sequence an engine holds: the longest prompt plus the longest response."""
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    @property
    def staleness_bound(self) -> int:
        """The most updates a row's policy can be behind the update that trains it: s plus the
        batch's later mini-batch updates (fixed mode), or max_staleness (bounded mode)."""
        if self.bounded_staleness:
            return self.staleness.max_staleness
        return self.staleness.s + self.updates_per_step - 1

    @property
    def run_dir(self) -> Path:
        """The run's directory: `run.output_dir / run.name`."""
        return Path(self.run.output_dir) / self.run.name

    @property
    def bounded_staleness(self) -> bool:
        """Separate rollouts bound staleness by `max_staleness`; colocated ones fix it at `s`."""
        return self.rollout.mode == "separate"

    @property
    def queue_batches(self) -> int:
        """K: rollout batches held in the staleness FIFO, s = K * updates_per_step."""
        return self.staleness.s // self.updates_per_step


# --- loading -------------------------------------------------------------------------------------


def load_recipe(path: str | Path, overrides: Sequence[str] = (), notes: list[str] | None = None) -> Recipe:
    """Read a TOML recipe, apply `--set` overrides, validate. Raises ConfigError.

    Errors name the file; those caused by an override name it as `FILE (--set)`. `--set
    loss.type=X` switches the loss: the keys of the file's `[loss]` that X does not take are dropped,
    and `notes` (if given) gets one line saying which.
    """

    def switch_loss(tree: dict[str, Any], key: str, value: Any) -> None:
        loss = tree.get("loss")
        if key != "loss.type" or not isinstance(loss, dict) or loss.get("type", "m2po") == value:
            return
        dropped = sorted(k for k in loss if k != "type" and k not in LOSS_KEYS.get(value, set()))
        for k in dropped:
            del loss[k]
        if dropped and notes is not None:
            names = ", ".join(f"loss.{k}" for k in dropped)
            notes.append(f'{path} (--set): loss.type = "{value}" drops {names}, which {value} does not take')

    return load(Recipe, Path(path), overrides, prepare=_arrays_as_tuples, before_set=switch_loss)


def _arrays_as_tuples(tree: dict[str, Any]) -> None:
    # TOML has arrays, the strict schema has fixed-length tuples.
    optim = tree.get("optim")
    if isinstance(optim, dict) and isinstance(optim.get("betas"), list):
        optim["betas"] = tuple(optim["betas"])
