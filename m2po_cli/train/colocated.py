"""Colocated rollouts: every rank holds a vLLM engine beside its learner, and the two alternate.

Groups of `rollout.tensor_parallel_size` consecutive ranks share one engine. Each engine samples its
own contiguous share of a rollout batch's prompts; the first rank of its group grades and packs those
rows, and `packed.distribute` sends every rank only the rows it trains. The staleness FIFO delays
every batch by exactly `s` updates (the paper's mechanism); the weights go to the engines after a
step's last update, which wakes them.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from m2po_cli.checkpoint import Restored
from m2po_cli.config import Recipe
from m2po_cli.data import PromptBatches
from m2po_cli.device import resolve_dtype
from m2po_cli.distributed import all_reduce
from m2po_cli.grader import Grader, grader_workers, recipe_grader
from m2po_cli.learner.optimizer_state import allocate_state
from m2po_cli.learner.policy import Learner
from m2po_cli.record import Recorder
from m2po_cli.rollout.engine import RolloutEngine, VLLMEngine
from m2po_cli.rollout.episode import Episodes, sample_episodes
from m2po_cli.rollout.settings import request_seed
from m2po_cli.run_dir import GENERATED_TOKENS, NEWEST_REWARD, NEWEST_VERSION
from m2po_cli.schedule import Schedule
from m2po_cli.torchrun import launch
from m2po_cli.train.fifo import StalenessQueue
from m2po_cli.train.pack import grade_and_pack
from m2po_cli.train.packed import PackedRollouts, distribute
from m2po_cli.train.push import PUSH_MISMATCH, Pusher
from m2po_cli.train.runlog import RunLog

# Rows per rank scored at the behaviour version for the mismatch metrics when nothing else needs them.
MISMATCH_SAMPLE_ROWS = 4


class ColocatedSource:
    """Rollouts from this rank's engine through the staleness FIFO (`RolloutSource` of `train`)."""

    mode = "colocated"

    @staticmethod
    def check(recipe: Recipe, world: int) -> None:
        """Nothing of its own: the loop checks the launch (`Recipe.launch_problem`) for every mode."""

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
    ):
        self.recipe, self.learner, self.prompts, self.recorder = recipe, learner, prompts, recorder
        self.queue = StalenessQueue(recipe.queue_batches)
        self.newest: dict[str, float] = {}
        self._stack = ExitStack()
        try:
            self.grader = None
            if learner.rank % recipe.rollout.tensor_parallel_size == 0:  # grades the rows its engine samples
                local = launch().local_world // recipe.rollout.tensor_parallel_size
                workers = grader_workers(max(1, local))
                self.grader = self._stack.enter_context(recipe_grader(recipe, workers))
            self.engine = build_engine(model_dir, recipe, learner.world, log)
            self._stack.callback(self.engine.close)
            self.sampler = Sampler(self.engine, self.grader, episodes)
            vocab = len(self.engine.tokenizer)
            self.pusher = Pusher(learner, self.engine, recipe.run_dir, recipe.model.path, vocab)
            self._stack.callback(self.pusher.close)
            if restored is not None:  # the engine gets the restored weights at `start`
                self.queue.load(restored.path, learner.rank, learner.world)
        except BaseException:
            self._stack.close()
            raise

    def start(self, first_step: int) -> None:
        """Fill the FIFO with its K warm-up batches, from the initial policy (not counted as steps).

        First, what the first step after the warm-up does: the optimizer's state allocated, the engine
        put to sleep and woken by a push of the learner's weights (those it was built from, or a
        resumed run's). A wake that does not fit beside the learner, or a push that fails its checks,
        stops the run in its first minutes, not after the K batches (1-2 hours at the 8B recipe)."""
        allocate_state(self.learner.optimizer)
        self.engine.sleep()
        self.pusher.push()
        while not self.queue.warm:
            self.queue.push(self._rollout(len(self.queue.queue) - self.recipe.queue_batches))

    def next_batch(self, step: int) -> PackedRollouts:
        """Generate this step's batch, hand back the one generated K steps ago; the engine sleeps
        (the learner gets the device) until the push after the step's last update wakes it."""
        self.queue.push(self._rollout(step))
        batch = self.queue.pop()
        self.engine.sleep()
        return batch

    def after_update(self, learner: Learner) -> None:
        """The engine samples again only after a step's last update, so the push waits for it."""
        if learner.version % self.recipe.updates_per_step == 0:
            self.pusher.push()

    def state(self) -> dict:
        return {"data": self.prompts.state_dict()}

    def save(self, folder: Path) -> None:
        """This rank's FIFO, beside the learner's shards."""
        self.queue.save(folder, self.learner.rank, self.learner.world)

    def take_metrics(self) -> dict[str, float]:
        """The reward of the batch this step generated and the policy version that generated it
        (`rollout/newest_reward_mean`, `staleness/newest_version`: the current policy's reward, which
        the trained batch's `rollout/reward_mean` shows only s updates later), the last push check's mean
        engine-learner logprob gap (`rollout/push_check_mismatch`); on GPU the device memory
        free right after this step's wakes (`mem/free_after_wake_*_gb`, the least over ranks)."""
        out, self.newest = self.newest | {PUSH_MISMATCH: self.pusher.mismatch}, {}
        free = self.engine.free_at_wake
        if not free:
            return out
        keys = sorted(free)
        least = all_reduce(
            torch.tensor([float(free[k]) for k in keys], dtype=torch.float64), dist.ReduceOp.MIN
        )
        free.clear()
        return out | {f"mem/free_after_wake_{k}_gb": float(v) / 1e9 for k, v in zip(keys, least, strict=True)}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ColocatedSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rollout(self, index: int) -> PackedRollouts:
        batch = rollout(self.sampler, self.prompts, self.learner, self.recipe, self.recorder, index)
        self.newest = {NEWEST_REWARD: batch.meta.pop(NEWEST_REWARD), NEWEST_VERSION: float(batch.version)}
        return batch


class Sampler(NamedTuple):
    """What samples and scores a rank's share: its engine, its grader (the first rank of an engine
    group only) and the run's episodes."""

    engine: RolloutEngine
    grader: Grader | None
    episodes: Episodes


def rollout(
    sampler: Sampler,
    prompts: PromptBatches,
    learner: Learner,
    recipe: Recipe,
    recorder: Recorder,
    index: int,
) -> PackedRollouts:
    """Sample and grade rollout step `index`'s batch with the current policy (each engine its share),
    give each rank its rows; trained at step `index + K`. Its rows are all scored at the behaviour
    version when they are the behaviour logprobs or when that step is recorded."""
    prompt_batch = next(prompts)  # every rank advances its iterator, so all hold the same data state
    batch = generate_share(sampler, prompt_batch, learner, recipe, index)
    batch = distribute(batch, Schedule.of(recipe))
    recorded = recorder.due(index + recipe.queue_batches)
    everything = recipe.algorithm.behaviour_logprobs == "learner" or recorded
    score_at_behaviour_version(batch, learner, everything, recipe.rollout.n, index)
    return batch


def build_engine(model_dir: Path, recipe: Recipe, world: int, log: RunLog | None) -> VLLMEngine:
    """This rank's rollout engine, on this rank's device (every rank builds one at the same time;
    the launch was checked before, `ColocatedSource.check`)."""
    return VLLMEngine(
        model_dir,
        recipe.rollout,
        resolve_dtype(recipe.model.dtype),
        recipe.max_model_len,
        world=world,
        log=log.message if log is not None else None,
        lora_rank=recipe.lora.rank,
    )


def engine_share(rank: int, world: int, tp: int, num_prompts: int) -> tuple[int, range]:
    """This rank's engine group (`tp` consecutive ranks) and the prompts it samples: the `world / tp`
    groups take contiguous shares, the first ones one prompt longer when uneven (`torch.tensor_split`)."""
    group = rank // tp
    size, extra = divmod(num_prompts, world // tp)
    start = group * size + min(group, extra)
    return group, range(start, start + size + (group < extra))


def generate_share(
    sampler: Sampler, prompt_batch: list, learner: Learner, recipe: Recipe, index: int
) -> PackedRollouts:
    """This engine's share of the batch: its episodes sampled by every rank of its group (vLLM's
    external launcher needs the same prompts on each, so an environment must answer alike on each),
    graded and packed by the group's first rank, the others holding no rows. Rows keep their global numbers (prompt-major). A collective: the timings
    are the slowest engine's (`time/generate`) and the slowest grader's (`time/grade`), the tokens
    every engine's (`rollout/generated_tokens`) and the busiest and idlest engine's
    (`rollout/engine_tokens_max`, `_min`: a straggler, or an engine that generated nothing), and the
    whole batch's mean reward (`NEWEST_REWARD`).
    """
    tp, n = recipe.rollout.tensor_parallel_size, recipe.rollout.n
    _, share = engine_share(learner.rank, learner.world, tp, len(prompt_batch))
    mine = [prompt_batch[i] for i in share]
    batch = PackedRollouts.empty(learner.version)
    t0 = time.perf_counter()
    seeds = [request_seed(recipe.run.seed, index, i) for i in share]  # by the prompt's place in the batch
    groups = sample_episodes(sampler.engine.generate, sampler.episodes, mine, seeds)
    t_gen = time.perf_counter() - t0
    if mine and learner.rank % tp == 0:
        versions = [learner.version] * len(mine)
        problems, tokens = [p.problem for p in mine], [p.token_ids for p in mine]
        episodes = [g.episodes for g in groups]
        packs = grade_and_pack(sampler.grader, problems, tokens, episodes, versions, recipe.algorithm)
        batch = PackedRollouts.cat(packs, torch.arange(share.start * n, share.stop * n))
    t_grade = time.perf_counter() - t0 - t_gen
    # One MAX reduction gives the slowest times and the busiest and idlest engine (max of -tokens);
    # only a group's first rank speaks for its engine.
    tokens = float(batch.trained_len_B.sum())  # the tokens the engine sampled
    engine = [tokens, -tokens] if learner.rank % tp == 0 else [-math.inf, -math.inf]
    largest = all_reduce(torch.tensor([t_gen, t_grade, *engine], dtype=torch.float64), dist.ReduceOp.MAX)
    totals = [tokens, float(batch.rewards_B.double().sum()), float(batch.num_rows)]
    generated = all_reduce(torch.tensor(totals, dtype=torch.float64), dist.ReduceOp.SUM)
    batch.meta = {
        "time/generate": float(largest[0]),
        "time/grade": float(largest[1]),
        GENERATED_TOKENS: float(generated[0]),
        "rollout/engine_tokens_max": float(largest[2]),
        "rollout/engine_tokens_min": -float(largest[3]),
        NEWEST_REWARD: float(generated[1] / generated[2].clamp(min=1)),
    }
    return batch


def score_at_behaviour_version(
    batch: PackedRollouts, learner: Learner, everything: bool, group_size: int, index: int = 0
) -> None:
    """The learner's logprobs of this rank's rows at the version that generated them, and the
    engine-vs-learner mismatch metrics. A collective.

    With `everything` every row is scored and kept as `learner_R`; otherwise only a sample, for the
    metrics alone (`mismatch_sample`).
    """
    sample = torch.arange(batch.num_rows) if everything else mismatch_sample(batch, group_size, index)
    rows = batch.to_batch(sample)
    t0 = time.perf_counter()
    logprobs_BL, entropy_BL = learner.score(rows, with_entropy=True)
    mask_BL = rows.mask_BL.bool()
    if everything:
        batch.set_learner_logprobs(logprobs_BL, mask_BL)
    diff_BL = (logprobs_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL
    sums = torch.stack([diff_BL.sum(), rows.mask_BL.sum(), (entropy_BL * rows.mask_BL).sum()]).double()
    largest = diff_BL.max() if diff_BL.numel() else torch.zeros(())
    sums, largest = all_reduce(sums, dist.ReduceOp.SUM), all_reduce(largest, dist.ReduceOp.MAX)
    n = sums[1].clamp(min=1)
    batch.meta.update(
        {
            "rollout/logprob_mismatch_mean": float(sums[0] / n),
            "rollout/logprob_mismatch_max": float(largest),
            "rollout/entropy": float(sums[2] / n),
            "time/score": time.perf_counter() - t0,
        }
    )


def mismatch_sample(batch: PackedRollouts, group_size: int, index: int) -> torch.Tensor:
    """The rows scored for the mismatch metrics: up to `MISMATCH_SAMPLE_ROWS` of one prompt group
    of this rank (the rollout batch numbers its rows prompt-major, `group_size` to a prompt), the
    `index`-th group in turn. One prompt, so the learner computes it once for them all
    (`shared_prompts`): about a third of the tokens of as many rows of different prompts."""
    groups_B = batch.row_B // group_size
    here = groups_B.unique()
    if not here.numel():
        return torch.zeros(0, dtype=torch.long)
    members = (groups_B == here[index % here.numel()]).nonzero().squeeze(1)
    return members[:MISMATCH_SAMPLE_ROWS]
