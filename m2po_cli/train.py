"""`m2po train`: the loop. One named call per phase; staleness is a visible variable of the loop.

Every rank holds a rollout engine (colocated: the engine shares the learner's devices and the two
alternate); groups of `rollout.tensor_parallel_size` consecutive ranks share one. Each engine samples
its own contiguous share of a rollout batch's prompts; the first rank of its group grades and packs
those rows, and `packed.distribute` sends every rank only the rows it trains. Rank 0 writes the run log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from m2po_cli import checkpoint
from m2po_cli.config import Recipe
from m2po_cli.data import Problem, PromptBatches, load_problems
from m2po_cli.device import resolve_dtype
from m2po_cli.errors import RunError
from m2po_cli.grader import Grader, grader_workers
from m2po_cli.learner import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import check_model_dir, load_tokenizer, resolve_model
from m2po_cli.packed import PackedRollouts, all_gather_rows, distribute, owners, pack_groups
from m2po_cli.record import Recorder, Sample
from m2po_cli.rollout import RolloutEngine, VLLMEngine
from m2po_cli.runlog import RunLog
from m2po_cli.staleness import StalenessQueue

# Rows per rank scored at the behaviour version for the mismatch metrics when nothing else needs them.
MISMATCH_SAMPLE_ROWS = 4


def train(recipe: Recipe, problems: list[Problem] | None = None) -> Path:
    """Run a recipe to completion (resuming from the run's last checkpoint); return the run dir.

    `problems` is the loaded prompt set when the caller has already read it (the CLI checks it first).
    """
    if recipe.rollout.mode == "separate":
        from m2po_cli.async_loop import train_separate

        return train_separate(recipe, problems)
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    model_dir = resolve_model(recipe.model.path)
    # Cheap checks before anything expensive starts: the model's files, the prompt set and its template.
    check_model_dir(model_dir)
    prompts = PromptBatches(
        load_problems(recipe.data) if problems is None else problems,
        load_tokenizer(model_dir),
        recipe.data,
        recipe.rollout.prompts_per_step,
    )
    stack = ExitStack()  # closes what set-up started, whichever step fails
    try:
        learner = Learner(model_dir, recipe)
        rank = learner.rank
        torch.manual_seed(recipe.run.seed)
        loss_fn = build_loss(recipe.loss)
        queue = StalenessQueue(recipe.queue_batches)
        recorder = Recorder(run_dir, recipe.inspect, recipe.run.seed, rank, learner.world)
        grader = log = None
        if rank == 0:
            log = RunLog(run_dir, recipe, learner.world)
            stack.callback(log.close)
        if rank % recipe.rollout.tensor_parallel_size == 0:  # grades the rows its engine samples
            local_graders = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) // recipe.rollout.tensor_parallel_size
            grader = stack.enter_context(Grader(num_workers=grader_workers(max(1, local_graders))))
        engine = build_engine(model_dir, recipe, learner.world, log)
        stack.callback(engine.close)

        first_step = resume(run_dir, recipe, learner, queue, prompts, engine, log)
        recorder.start(first_step)
        if log is not None:
            log.start(first_step)
            if first_step:
                log.message(f"resumed at step {first_step}, policy version {learner.version}")
        while not queue.warm:  # warm-up batches: from the initial policy, not counted as steps
            index = len(queue.queue) - recipe.queue_batches  # trained at step index + K
            queue.push(rollout(engine, grader, prompts, learner, recipe, recorder, index))
        for step in range(first_step, recipe.run.steps):
            t0 = time.perf_counter()
            queue.push(rollout(engine, grader, prompts, learner, recipe, recorder, step))
            batch = queue.pop()
            staleness = learner.version - batch.version
            t1 = time.perf_counter()
            engine.sleep()  # the learner gets the device (GPU); the push at the end wakes the engine
            metrics = train_on(
                batch, learner, loss_fn, at_step_end(engine, recipe.updates_per_step), recipe, recorder, step
            )
            metrics.update(rollout_metrics(batch, staleness))
            metrics.update({"time/rollout": t1 - t0, "time/train": time.perf_counter() - t1})
            metrics["time/step"] = time.perf_counter() - t0
            if log is not None:
                log.log(step, metrics)
            if checkpoint_due(recipe, step):
                loop_state = {"step": step + 1, "data": prompts.state_dict()}
                checkpoint.save(run_dir, step + 1, learner, loop_state, recipe.checkpoint.keep, queue)
        if recipe.checkpoint.export_hf:
            learner.export_hf(run_dir / "export", model_dir)
    finally:
        stack.close()
    if log is not None:
        log.message(log.summary())
    return run_dir


def checkpoint_due(recipe: Recipe, step: int) -> bool:
    """Whether the loop saves a checkpoint after `step`: every `checkpoint.every` steps, and the last."""
    every = recipe.checkpoint.every
    return bool(every and (step + 1) % every == 0) or step + 1 == recipe.run.steps


def build_engine(model_dir: Path, recipe: Recipe, world: int, log: RunLog | None) -> VLLMEngine:
    """This rank's rollout engine, on this rank's device (every rank builds one at the same time)."""
    problem = recipe.rollout.launch_problem(world)
    if problem:
        raise RunError(problem)
    return VLLMEngine(
        model_dir,
        recipe.rollout,
        resolve_dtype(recipe.model.dtype),
        recipe.max_model_len,
        world=world,
        log=log.message if log is not None else None,
    )


def resume(
    run_dir: Path,
    recipe: Recipe,
    learner: Learner,
    queue: StalenessQueue,
    prompts: PromptBatches,
    engine: RolloutEngine | None,
    log: RunLog | None,
) -> int:
    """Restore the run's newest checkpoint that verifies, if any; return the number of steps done."""
    if recipe.checkpoint.resume != "auto":
        return 0
    last, skipped = checkpoint.choose(run_dir)
    for path, problem in skipped:
        if log is not None:
            log.message(f"skipping damaged checkpoint {path}: {problem}")
    if last is None:
        return 0
    if "in_flight" in checkpoint.read_loop(last):
        raise RunError(f"{last}: checkpoint of a separate-mode run; resume it with rollout.mode = separate")
    loop = checkpoint.load(last, learner, queue)
    prompts.load_state_dict(loop["data"])
    sync_weights(learner, engine)  # the engine still holds the initial weights
    return loop["step"]


def rollout(
    engine: RolloutEngine | None,
    grader,
    prompts: PromptBatches,
    learner: Learner,
    recipe: Recipe,
    recorder: Recorder,
    index: int,
) -> PackedRollouts:
    """Sample and grade one batch with the current policy (each engine its share), give each rank its rows.

    The batch of rollout step `index` is trained at step `index + K`; its rows are all scored at
    the behaviour version when they are the behaviour logprobs or when that step is recorded.
    """
    prompt_batch = next(prompts)  # every rank advances its iterator, so all hold the same data state
    batch = generate_share(engine, grader, prompt_batch, learner, recipe, index)
    batch = distribute(batch, owners(batch.row_B, rows_per_update(recipe), learner.world))
    recorded = recorder.due(index + recipe.queue_batches)
    _score_at_behaviour_version(batch, learner, recipe.algorithm.behaviour_logprobs == "learner" or recorded)
    return batch


def engine_share(rank: int, world: int, tp: int, num_prompts: int) -> tuple[int, range]:
    """This rank's engine group (`tp` consecutive ranks) and the prompts it samples: the `world / tp`
    groups take contiguous shares, the first ones one prompt longer when uneven (`torch.tensor_split`)."""
    group = rank // tp
    size, extra = divmod(num_prompts, world // tp)
    start = group * size + min(group, extra)
    return group, range(start, start + size + (group < extra))


def generate_share(
    engine: RolloutEngine, grader, prompt_batch: list, learner: Learner, recipe: Recipe, index: int
) -> PackedRollouts:
    """This engine's share of the batch: sampled by every rank of its group (vLLM's external
    launcher needs the same prompts on each), graded and packed by the group's first rank, the
    others holding no rows. Rows keep their global numbers (prompt-major). A collective: the timings
    are the slowest engine's (`time/generate`) and the slowest grader's (`time/grade`).
    """
    tp, n = recipe.rollout.tensor_parallel_size, recipe.rollout.n
    engine_group, share = engine_share(learner.rank, learner.world, tp, len(prompt_batch))
    mine = [prompt_batch[i] for i in share]
    tokens = [p.token_ids for p in mine]
    batch = PackedRollouts.empty(learner.version)
    t0 = time.perf_counter()
    groups = engine.generate(tokens, _seed(recipe.run.seed, index, engine_group)) if mine else []
    t_gen = time.perf_counter() - t0
    if mine and learner.rank % tp == 0:
        golds = [p.problem.answer for p in mine for _ in range(n)]
        rewards = grader.grade_many([c.text for group in groups for c in group], golds)
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(mine), n)
        a = recipe.algorithm
        batch = pack_groups(
            learner.version, share.start * n, tokens, groups, rewards_PG, a.normalize_std, a.std_eps
        )
    t_grade = time.perf_counter() - t0 - t_gen
    slowest = _all_reduce(torch.tensor([t_gen, t_grade], dtype=torch.float64), dist.ReduceOp.MAX)
    batch.meta = {"time/generate": float(slowest[0]), "time/grade": float(slowest[1])}
    return batch


def rows_per_update(recipe: Recipe) -> int:
    return recipe.prompts_per_update * recipe.rollout.n


def _score_at_behaviour_version(batch: PackedRollouts, learner: Learner, everything: bool) -> None:
    """The learner's logprobs of this rank's rows at the version that generated them, and the
    engine-vs-learner mismatch metrics. A collective.

    With `everything` every row is scored and kept as `learner_R`; otherwise only a sample of
    `MISMATCH_SAMPLE_ROWS` rows per rank is scored, for the metrics alone.
    """
    num = batch.num_rows if everything else min(MISMATCH_SAMPLE_ROWS, batch.num_rows)
    index = (
        torch.linspace(0, batch.num_rows - 1, num).round().long() if num else torch.zeros(0, dtype=torch.long)
    )
    rows = batch.to_batch(torch.arange(batch.num_rows) if everything else index)
    t0 = time.perf_counter()
    logprobs_BL, entropy_BL = learner.score(rows, with_entropy=True)
    mask_BL = rows.mask_BL.bool()
    if everything:
        batch.learner_R = logprobs_BL[mask_BL]
    diff_BL = (logprobs_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL
    sums = torch.stack([diff_BL.sum(), rows.mask_BL.sum(), (entropy_BL * rows.mask_BL).sum()]).double()
    largest = diff_BL.max() if diff_BL.numel() else torch.zeros(())
    sums, largest = _all_reduce(sums, dist.ReduceOp.SUM), _all_reduce(largest, dist.ReduceOp.MAX)
    n = sums[1].clamp(min=1)
    batch.meta.update(
        {
            "rollout/logprob_mismatch_mean": float(sums[0] / n),
            "rollout/logprob_mismatch_max": float(largest),
            "rollout/entropy": float(sums[2] / n),
            "time/score": time.perf_counter() - t0,
        }
    )


def train_on(
    batch: PackedRollouts,
    learner: Learner,
    loss_fn,
    sync: Callable[[Learner], None] | None,
    recipe: Recipe,
    recorder: Recorder,
    step: int,
) -> dict[str, float]:
    """All optimizer updates of one rollout batch (this rank's rows); `sync(learner)` after each may
    send the weights out (colocated: after the last one, waking the engine up)."""
    per_update = rows_per_update(recipe)
    num_updates = recipe.updates_per_step
    update_B = batch.row_B // per_update
    tokens_U = torch.zeros(num_updates, dtype=torch.float64).index_add_(
        0, update_B, batch.response_len_B.double()
    )
    tokens_U = _all_reduce(tokens_U, dist.ReduceOp.SUM)  # the global token count of each update
    totals: dict[str, float] = {}
    for u in range(num_updates):
        index_K = (update_B == u).nonzero().squeeze(1)
        rows = batch.to_batch(index_K, recipe.algorithm.behaviour_logprobs)
        sample = record_sample(recorder, step, batch, index_K, learner)
        t0 = time.perf_counter()
        m = learner.update(rows, loss_fn, int(tokens_U[u]))
        t1 = time.perf_counter()
        recorder.add(sample, m)
        if sync is not None:
            sync(learner)
        m.update({"time/update": t1 - t0, "time/weight_sync": time.perf_counter() - t1})
        m["perf/learner_tokens_per_s"] = float(rows.lengths_B.sum()) * learner.world / (t1 - t0)
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v / num_updates
    totals["optim/version"] = learner.version
    recorder.write(step)
    return totals


def record_sample(
    recorder: Recorder, step: int, batch: PackedRollouts, index_K: torch.Tensor, learner: Learner
) -> Sample | None:
    """This rank's rows among the update's recorded ones, scored by the learner just before the update.

    The recorder chooses among all rows of the update (their ids and lengths gathered from every
    rank); each rank scores the chosen rows it holds. A collective.
    """
    if not recorder.due(step):
        return None
    rows_N = all_gather_rows(batch.row_B[index_K])  # in rank order, which is row order
    lengths_N = all_gather_rows(batch.response_len_B[index_K])
    picked, _ = recorder.pick(step, learner.version, rows_N.tolist(), lengths_N.tolist())
    chosen_N = all_gather_rows(torch.tensor(picked, dtype=torch.long))
    mine_K = index_K[torch.isin(batch.row_B[index_K], chosen_N)]
    padded = batch.to_batch(mine_K)
    logprobs_BL, entropy_BL = learner.score(padded, with_entropy=True)  # every rank, rows or not
    if not mine_K.numel():
        return None
    rows, mask_BL = batch.take(mine_K), padded.mask_BL.bool()

    def per_row(value: int) -> torch.Tensor:
        return torch.full((rows.num_rows,), value, dtype=torch.long)

    scored = bool(batch.learner_R.numel())  # every row was scored at its behaviour version
    return Sample(
        behaviour_logprobs_N=rows.behaviour_R,
        learner_logprobs_N=rows.learner_R if scored else torch.zeros_like(rows.behaviour_R),
        logprobs_N=logprobs_BL[mask_BL],
        entropy_N=entropy_BL[mask_BL],
        lengths_R=rows.response_len_B,
        advantages_R=rows.advantages_B,
        staleness_R=learner.version - rows.version_B,
        update_R=per_row(learner.version),
        row_R=rows.row_B,
        scored_R=torch.full((rows.num_rows,), scored),
    )


def at_step_end(engine: RolloutEngine | None, updates_per_step: int) -> Callable[[Learner], None]:
    """Colocated: the engine samples again only after a step's last update, so the push waits for it."""

    def sync(learner: Learner) -> None:
        if learner.version % updates_per_step == 0:
            sync_weights(learner, engine)

    return sync


def sync_weights(learner: Learner, engine: RolloutEngine | None) -> None:
    """Stream the learner's weights into this rank's engine; every rank at once (a collective)."""
    if engine is not None:
        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)


def rollout_metrics(batch: PackedRollouts, staleness: int) -> dict[str, float]:
    """Metrics of the whole rollout batch (a collective: sums over every rank's rows)."""
    lengths_B = batch.response_len_B.double()
    sums = torch.stack(
        [
            torch.tensor(float(batch.num_rows)),
            batch.rewards_B.double().sum(),
            batch.solved_B.double().sum(),
            lengths_B.sum(),
            batch.finished_B.double().sum(),
        ]
    ).double()
    num_rows, rewards, solved, tokens, finished = _all_reduce(sums, dist.ReduceOp.SUM).tolist()
    num_rows = max(num_rows, 1.0)
    metrics = {
        "rollout/reward_mean": rewards / num_rows,
        "rollout/solved_groups": solved / num_rows,  # every row of a group carries its group's flag
        "rollout/response_tokens_mean": tokens / num_rows,
        "rollout/truncated_frac": 1.0 - finished / num_rows,
        "staleness/min": float(staleness),
        "staleness/mean": float(staleness),
        "staleness/max": float(staleness),
        "staleness/behaviour_version": float(batch.version),
        **batch.meta,
    }
    if "time/generate" in batch.meta:  # every engine's tokens over the slowest engine's time
        metrics["perf/rollout_tokens_per_s"] = tokens / max(batch.meta["time/generate"], 1e-9)
    return metrics


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        y = x.to(device) if device else x.clone()
        dist.all_reduce(y, op=op)
        return y.cpu()
    return x


def _seed(run_seed: int, index: int, engine_group: int = 0) -> int:
    """The sampling seed of one engine for rollout step `index`: fixed by the run's seed, so a resumed
    run samples what the uninterrupted one did; engine group 0 has the one-engine run's seed."""
    return (run_seed * 1_000_003 + (index + 1_000) * 10_007 + engine_group * 1_000_000_007) % 2**31
