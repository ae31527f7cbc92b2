"""The recipe's `[train]`, `[parallel]`, `[optim]` and `[lora]` tables: the learner's batching, its
ranks' layout, its optimizer and the low-rank adapter it may train instead of every weight."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from m2po_cli.config.tables import Table, field


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

    def layout_advice(self, world: int, local_world: int, num_params: int) -> str | None:
        """A one-line suggestion for a launch of `world` processes, `local_world` a node, when the
        model is sharded over several nodes with no replicas (plain FSDP: every layer's gathers and
        gradient reduce-scatters cross the network); None otherwise. HSDP is suggested, not taken:
        with a replica a node, each GPU holds `nodes` times the learner state it holds under FSDP
        (16 bytes a parameter: fp32 weights, gradients, two AdamW moments), which a model that fits
        under FSDP may not fit (docs/cluster.md, "How the learner spans nodes")."""
        nodes = world // local_world
        if self.dp_replicate != 1 or nodes < 2 or world % local_world:
            return None
        state_gb = 16 * num_params / 1e9
        return (
            f"parallel.dp_replicate is 1 on {nodes} nodes: FSDP gathers every layer across nodes in each "
            f"forward and backward; HSDP (parallel.dp_replicate = {nodes}, dp_shard = -1) keeps them within "
            f"a node and sends only gradients between nodes, at {state_gb / local_world:.1f} GB of learner "
            f"state a GPU instead of {state_gb / world:.1f} GB"
        )


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


# The projections a LoRA adapter may target, by their HF names (every supported model family has them).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Table):
    """Train a low-rank adapter (LoRA) on frozen base weights: the optimizer holds state for the
    adapter alone, and each weight sync carries it alone (docs/lora.md)."""

    rank: int = field(0, "Adapter rank r; 0 trains every weight (full fine-tuning).", ge=0, le=512)
    alpha: float = field(32.0, "Scaling: the adapter adds (alpha / rank) * B A x to each target.", gt=0)
    dropout: float = field(
        0.0,
        "Dropout on the adapter's input in the training forwards (not when scoring, nor in the engine).",
        ge=0,
        lt=1,
    )
    target_modules: tuple[str, ...] = field(
        LORA_TARGETS,
        "Projections that get an adapter, by HF name (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj); k_proj and v_proj go together.",
    )
    export_merged: bool = field(
        False,
        "Also export the base weights with the adapter merged in, as HF safetensors in `<run>/export` "
        "(the adapter alone goes to `<run>/adapter` in PEFT format).",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in targets if m not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not one of {', '.join(LORA_TARGETS)}")
        if not targets:
            raise ValueError("name at least one projection")
        if ("k_proj" in targets) != ("v_proj" in targets):
            raise ValueError("k_proj and v_proj go together (the learner builds both from one config)")
        return targets

    @property
    def enabled(self) -> bool:
        return self.rank > 0
