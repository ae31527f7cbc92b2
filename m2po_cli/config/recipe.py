"""The recipe: its tables together, the checks across tables, the facts derived from them, and the
loader (defaults < file < `--set`). Imports neither torch nor vllm, so `--dry-run` and validation
errors are fast."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import model_validator

from m2po_cli.config.data import DataConfig, ModelConfig, RewardConfig
from m2po_cli.config.env import EnvConfig
from m2po_cli.config.learner import LoraConfig, OptimConfig, ParallelConfig, TrainConfig
from m2po_cli.config.loss import LOSS_KEYS, AlgorithmConfig, LossConfig, M2POLoss
from m2po_cli.config.rollout import ReuseConfig, RolloutConfig, StalenessConfig
from m2po_cli.config.tables import Table, field, load


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
    env: EnvConfig = field(EnvConfig(), "The environment of multi-turn episodes: tools, feedback, limits.")
    loss: LossConfig = field(M2POLoss(), "Policy loss; `type` selects the loss.")
    train: TrainConfig = field(TrainConfig(), "Batching of the learner.")
    parallel: ParallelConfig = field(
        ParallelConfig(), "How the learner's ranks shard and replicate the model."
    )
    optim: OptimConfig = field(OptimConfig(), "Optimizer and schedule.")
    lora: LoraConfig = field(LoraConfig(), "Low-rank adapter training (off unless `rank` > 0).")
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
        """The longest sequence an engine holds: the longest prompt plus the longest response (an
        episode's turns and environment messages together)."""
        return self.data.max_prompt_tokens + self.env.episode_tokens(self.rollout.max_new_tokens)

    @property
    def reads_columns(self) -> bool:
        """Whether the prompt set keeps each record's other fields: a reward function or an
        environment reads them."""
        return bool(self.reward.function or self.env.name)

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


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), notes: list[str] | None = None, files: bool = True
) -> Recipe:
    """Read a TOML recipe, apply `--set` overrides, validate. Raises ConfigError.

    Errors name the file; those caused by an override name it as `FILE (--set)`. `--set
    loss.type=X` switches the loss: the keys of the file's `[loss]` that X does not take are dropped,
    and `notes` (if given) gets one line saying which. `files=False`: the model's folder and the
    data file are not looked for (a run directory's recipe, read where they may not be).
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

    return load(Recipe, Path(path), overrides, prepare=_arrays_as_tuples, before_set=switch_loss, files=files)


def _arrays_as_tuples(tree: dict[str, Any]) -> None:
    # TOML has arrays, the strict schema has fixed-length tuples.
    for table, key in (("optim", "betas"), ("lora", "target_modules")):
        node = tree.get(table)
        if isinstance(node, dict) and isinstance(node.get(key), list):
            node[key] = tuple(node[key])
