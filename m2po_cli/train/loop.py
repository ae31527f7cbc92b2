"""`m2po train`: the loop. One named call per phase; staleness is a visible variable of the loop.

The rollout source is chosen once from the recipe (`rollout.mode`): colocated (an engine beside
every learner rank, batches delayed by the staleness FIFO; `colocated.py`) or separate (`vllm
serve` engines generating while the learner trains; `separate.py`). Both give each rank its rows of
the step's batch, take the learner's weights when their rule says (`after_update`), and carry what a
checkpoint needs to resume without losing or repeating a prompt. Rank 0 writes the run log.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch

from m2po_cli import checkpoint
from m2po_cli.checkpoint import Restored
from m2po_cli.config import Recipe
from m2po_cli.data import Problem, PromptBatches, load_problems
from m2po_cli.environment import load_environment
from m2po_cli.errors import RunError
from m2po_cli.grader import load_reward
from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import check_model_dir, load_tokenizer, resolve_model
from m2po_cli.record import Recorder
from m2po_cli.rollout.episode import Episodes, build_episodes
from m2po_cli.run_dir import ADAPTER, EXPORT, GENERATED_TOKENS, STEP_SECONDS
from m2po_cli.torchrun import launch
from m2po_cli.train.colocated import ColocatedSource
from m2po_cli.train.packed import PackedRollouts
from m2po_cli.train.reuse import Reuse, build_reuse
from m2po_cli.train.runlog import RunLog
from m2po_cli.train.separate import SeparateSource
from m2po_cli.train.updates import rollout_metrics, train_on


class RolloutSource(Protocol):
    """Where a step's rollout batch comes from, and when the engines get the learner's weights.

    Built once per run from what the loop holds (`restored`: the checkpoint it resumes from, if
    any) and used as a context manager: leaving it stops what it started (engines, graders)."""

    mode: str

    def __init__(
        self,
        model_dir: Path,
        recipe: Recipe,
        learner: Learner,
        prompts: PromptBatches,
        episodes: Episodes,
        recorder: Recorder,
        log: RunLog | None,
        restored: Restored | None,
    ) -> None: ...

    def __enter__(self) -> RolloutSource: ...

    def __exit__(self, *exc: object) -> None: ...

    @staticmethod
    def check(recipe: Recipe, world: int) -> None:
        """Cheap checks of the recipe against the launch, before anything starts (raises RunError)."""

    def start(self, first_step: int) -> None:
        """Before the first step: colocated fills the FIFO, separate pushes the weights and starts."""

    def next_batch(self, step: int) -> PackedRollouts:
        """This rank's rows of the step's batch, with the source's metrics in `meta`. A collective."""

    def after_update(self, learner: Learner) -> None:
        """Called after every optimizer update: send the weights if the source's rule says so."""

    def state(self) -> dict:
        """What `loop.pt` carries for the source (rank 0): the data position, prompts in flight."""

    def save(self, folder: Path) -> None:
        """This rank's own files in a checkpoint folder."""

    def take_metrics(self) -> dict[str, float]:
        """The source's metrics since the last call."""

    def close(self) -> None: ...


ZERO_REWARD_STEPS = 2  # first steps that scored nothing before the console says so

SOURCES: dict[str, type[RolloutSource]] = {"colocated": ColocatedSource, "separate": SeparateSource}


def train(recipe: Recipe, problems: list[Problem] | None = None) -> Path:
    """Run a recipe to completion (resuming from the run's last checkpoint); return the run dir.

    `problems` is the loaded prompt set when the caller has already read it (the CLI checks it first).
    """
    run_dir, source_type = recipe.run_dir, SOURCES[recipe.rollout.mode]
    model_dir, prompts, episodes = prepare(recipe, source_type, problems)
    with ExitStack() as stack:  # closes what set-up started, whichever step fails
        learner = Learner(model_dir, recipe)
        torch.manual_seed(recipe.run.seed)
        loss_fn = build_loss(recipe.loss)
        log = stack.enter_context(RunLog(run_dir, recipe, learner.world)) if learner.rank == 0 else None
        first_step, restored = resume(run_dir, recipe, learner, prompts, log)
        recorder = Recorder(run_dir, recipe.inspect, recipe.run.seed, learner.rank, learner.world)
        recorder.start(first_step)
        source: RolloutSource = stack.enter_context(
            source_type(model_dir, recipe, learner, prompts, episodes, recorder, log, restored)
        )
        reuse = build_reuse(recipe)
        if restored is not None:
            reuse.load(restored.path, learner.rank, learner.world)
        source.start(first_step)
        for step in range(first_step, recipe.run.steps):
            t0 = time.perf_counter()
            batch = source.next_batch(step)
            t1 = time.perf_counter()
            plan = reuse.plan(batch, step, learner.version)
            metrics = train_on(plan, learner, loss_fn, source.after_update, recipe, recorder, step)
            metrics |= (
                reuse.after_step(batch, step) | rollout_metrics(batch, episodes) | source.take_metrics()
            )
            metrics |= step_times(t0, t1, metrics)
            if log is not None:
                log_step(log, recipe, step, metrics, batch, prompts.tokenizer)
            if checkpoint_due(recipe, step):
                loop_state = {"step": step + 1, "mode": source.mode, **source.state()}
                save = saver(source, reuse, learner)
                checkpoint.save(run_dir, step + 1, learner, loop_state, recipe.checkpoint.keep, save)
        if recipe.checkpoint.export_hf:
            export(learner, recipe, run_dir, model_dir)
    if log is not None:
        log.message(log.summary())
    return run_dir


def export(learner: Learner, recipe: Recipe, run_dir: Path, model_dir: Path) -> None:
    """The final policy: HF safetensors in `export/`; with LoRA the adapter in PEFT format in
    `adapter/`, and the merged weights in `export/` only when asked (`lora.export_merged`)."""
    if learner.lora is not None:
        learner.export_adapter(run_dir / ADAPTER)
    if learner.lora is None or recipe.lora.export_merged:
        learner.export_hf(run_dir / EXPORT, model_dir)


def prepare(
    recipe: Recipe, source_type: type[RolloutSource], problems: list[Problem] | None
) -> tuple[Path, PromptBatches, Episodes]:
    """Cheap checks before anything expensive starts (the CLI has checked the launch): the model's
    files, the rollout source's own needs, the reward function, the environment and the chat
    template's turns, the prompt set. Returns the model's folder, the prompt batches and the episodes."""
    source_type.check(recipe, launch().world)
    if recipe.reward.function:
        load_reward(recipe.reward.function)
    if recipe.env.name:  # the class, before a builtin model is built: its chat template comes after
        load_environment(recipe.env.name)
    model_dir = resolve_model(recipe.model.path)
    check_model_dir(model_dir)
    if problems is None:
        problems = load_problems(recipe.data, columns=recipe.reads_columns)
    tokenizer = load_tokenizer(model_dir)
    episodes = build_episodes(recipe, tokenizer, model_dir)
    per_step = recipe.rollout.prompts_per_step
    prompts = PromptBatches(problems, tokenizer, recipe.data, per_step, episodes.opening, episodes.tools)
    return model_dir, prompts, episodes


def log_step(log: RunLog, recipe: Recipe, step: int, metrics: dict, batch: PackedRollouts, tokenizer) -> None:
    """The step's line of the run log, and some of its rows as text when `logging.samples` asks; once,
    if every sample of the run's first steps scored 0, one of them on the console."""
    log.log(step, metrics)
    if recipe.logging.samples and step % recipe.logging.samples_every == 0:
        log.samples(step, batch_samples(batch, tokenizer, recipe.logging.samples))
    if log.rewards == [0.0] * ZERO_REWARD_STEPS:
        log.nothing_scored(batch_samples(batch, tokenizer, 1))


def saver(source: RolloutSource, reuse: Reuse, learner: Learner):
    """What each rank writes into a checkpoint folder beside its learner shards: the source's files
    and what reuse keeps (the replay buffer's rows)."""

    def save(folder: Path) -> None:
        source.save(folder)
        reuse.save(folder, learner.rank, learner.world)

    return save


def resume(
    run_dir: Path, recipe: Recipe, learner: Learner, prompts: PromptBatches, log: RunLog | None
) -> tuple[int, Restored | None]:
    """Restore the learner and the data position from the run's newest checkpoint that verifies,
    if any, and start the run log; return (steps done, the checkpoint for the rollout source)."""
    last, skipped = checkpoint.choose(run_dir) if recipe.checkpoint.resume == "auto" else (None, [])
    first_step, restored = 0, None
    if last is not None:
        mode = checkpoint.read_loop(last)["mode"]
        if mode != recipe.rollout.mode:
            raise RunError(f"{last}: checkpoint of a {mode}-mode run; resume it with rollout.mode = {mode}")
        loop = checkpoint.load(last, learner)
        prompts.load_state_dict(loop["data"])
        first_step, restored = loop["step"], Restored(last, loop)
    if log is not None:
        log.start(first_step)
        for path, problem in skipped:
            log.message(f"skipping damaged checkpoint {path}: {problem}")
        if first_step:
            log.message(f"resumed at step {first_step}, policy version {learner.version}")
    return first_step, restored


def batch_samples(batch: PackedRollouts, tokenizer, k: int) -> list[dict]:
    """k of this rank's rows of a trained batch, spread over them, as text: prompt, completion
    (special tokens dropped), reward and row number."""
    if not batch.num_rows:
        return []
    index = torch.linspace(0, batch.num_rows - 1, min(k, batch.num_rows)).round().long().unique()
    rows = batch.take(index)
    out = []

    def decode(ids: torch.Tensor) -> str:
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    for b, tokens in enumerate(rows.tokens_N.split(rows.lengths_B.tolist())):
        cut = int(rows.prompt_len_B[b])
        out.append(
            {
                "row": int(rows.row_B[b]),
                "reward": float(rows.rewards_B[b]),
                "prompt": decode(tokens[:cut]),
                "completion": decode(tokens[cut:]),
            }
        )
    return out


def checkpoint_due(recipe: Recipe, step: int) -> bool:
    """Whether the loop saves a checkpoint after `step`: every `checkpoint.every` steps, and after
    the last one if `checkpoint.final` asks."""
    every = recipe.checkpoint.every
    last = step + 1 == recipe.run.steps
    return bool(every and (step + 1) % every == 0) or (last and recipe.checkpoint.final)


def step_times(t0: float, t1: float, metrics: dict[str, float]) -> dict[str, float]:
    """The step's phases, and the engines' tokens over the step's wall time."""
    now = time.perf_counter()
    times = {"time/rollout": t1 - t0, "time/train": now - t1, STEP_SECONDS: now - t0}
    if GENERATED_TOKENS in metrics:
        times["perf/rollout_tokens_per_s"] = metrics[GENERATED_TOKENS] / max(now - t0, 1e-9)
    return times
