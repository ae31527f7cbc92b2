"""`m2po train`: the loop. One named call per phase; staleness is a visible variable of the loop.

Rank 0 owns the rollout engine and the grader (colocated: the engine shares the learner's devices and
the two alternate); every rank trains its slice of each optimizer batch; rank 0 broadcasts rollouts.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from m2po_cli import checkpoint
from m2po_cli.advantages import grpo_advantages
from m2po_cli.config import Recipe
from m2po_cli.data import Problem, PromptBatches, load_problems
from m2po_cli.grader import Grader
from m2po_cli.learner import Batch, Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import check_model_dir, resolve_model
from m2po_cli.record import Recorder, Sample
from m2po_cli.rollout import RolloutEngine, VLLMEngine, resolve_dtype
from m2po_cli.runlog import RunLog
from m2po_cli.staleness import RolloutBatch, StalenessQueue


def train(recipe: Recipe, problems: list[Problem] | None = None) -> Path:
    """Run a recipe to completion (resuming from the run's last checkpoint); return the run dir.

    `problems` is the loaded prompt set when the caller has already read it (the CLI checks it first).
    """
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    model_dir = resolve_model(recipe.model.path)
    # Cheap checks before anything expensive starts: the model's files, the prompt set and its template.
    check_model_dir(model_dir)
    prompts = PromptBatches(
        load_problems(recipe.data) if problems is None else problems,
        _tokenizer(model_dir),
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
            grader = stack.enter_context(Grader())
        engine = build_engine(model_dir, recipe, learner.world, log)
        stack.callback(engine.close)

        first_step = resume(run_dir, recipe, learner, queue, prompts, engine, log)
        recorder.start(first_step)
        if log is not None:
            log.start(first_step)
            if first_step:
                log.message(f"resumed at step {first_step}, policy version {learner.version}")
        while not queue.warm:  # warm-up batches: from the initial policy, not counted as steps
            queue.push(
                rollout(engine, grader, prompts, learner, recipe, len(queue.queue) - recipe.queue_batches)
            )
        for step in range(first_step, recipe.run.steps):
            t0 = time.perf_counter()
            queue.push(rollout(engine, grader, prompts, learner, recipe, step))
            batch = queue.pop()
            staleness = learner.version - batch.version
            t1 = time.perf_counter()
            engine.sleep()  # the learner gets the device (GPU); the push at the end wakes the engine
            metrics = train_on(batch, learner, loss_fn, engine, recipe, recorder, step)
            metrics.update(rollout_metrics(batch, staleness))
            metrics.update({"time/rollout": t1 - t0, "time/train": time.perf_counter() - t1})
            metrics["time/step"] = time.perf_counter() - t0
            if log is not None:
                log.log(step, metrics)
            every = recipe.checkpoint.every
            if (every and (step + 1) % every == 0) or step + 1 == recipe.run.steps:
                loop_state = {"step": step + 1, "queue": queue.state_dict(), "data": prompts.state_dict()}
                checkpoint.save(run_dir, step + 1, learner, loop_state, recipe.checkpoint.keep)
        if recipe.checkpoint.export_hf:
            learner.export_hf(run_dir / "export", model_dir)
    finally:
        stack.close()
    if log is not None:
        log.message(log.summary())
    return run_dir


def build_engine(model_dir: Path, recipe: Recipe, world: int, log: RunLog | None) -> VLLMEngine:
    """This rank's rollout engine, on this rank's device (every rank builds one at the same time)."""
    tp = recipe.rollout.tensor_parallel_size
    if world % tp:
        raise ValueError(f"rollout.tensor_parallel_size: {tp} does not divide the {world} ranks")
    return VLLMEngine(
        model_dir,
        recipe.rollout,
        resolve_dtype(recipe.model.dtype),
        _max_len(recipe),
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
    loop = checkpoint.load(last, learner)
    queue.load_state_dict(loop["queue"])
    prompts.load_state_dict(loop["data"])
    sync_weights(learner, engine)  # the engine still holds the initial weights
    return loop["step"]


def rollout(
    engine: RolloutEngine | None, grader, prompts: PromptBatches, learner: Learner, recipe: Recipe, index: int
) -> RolloutBatch:
    """Sample and grade one batch with the current policy (rank 0), share it, score it with the learner."""
    prompt_batch = next(prompts)  # every rank advances its iterator, so all hold the same data state
    batch = None
    if learner.rank == 0:
        t0 = time.perf_counter()
        groups = engine.generate([p.token_ids for p in prompt_batch], _seed(recipe.run.seed, index))
        t_gen = time.perf_counter() - t0
        samples = [c for group in groups for c in group]
        golds = [p.problem.answer for p in prompt_batch for _ in range(recipe.rollout.n)]
        rewards = grader.grade_many([c.text for c in samples], golds)
        batch = RolloutBatch(
            version=learner.version,
            problem_ids=[p.problem.index for p in prompt_batch],
            answers=[p.problem.answer for p in prompt_batch],
            prompts=[p.token_ids for p in prompt_batch],
            responses=[c.token_ids for c in samples],
            behaviour_logprobs=[c.logprobs for c in samples],
            texts=[c.text for c in samples],
            finished=[c.finished for c in samples],
            rewards_PG=torch.tensor(rewards, dtype=torch.float32).view(len(prompt_batch), recipe.rollout.n),
            meta={"time/generate": t_gen, "time/grade": time.perf_counter() - t0 - t_gen},
        )
    batch = _broadcast(batch)
    _score_at_behaviour_version(batch, learner)
    return batch


def _score_at_behaviour_version(batch: RolloutBatch, learner: Learner) -> None:
    """The learner's own logprobs of the batch at the version that generated it (all rows, every rank)."""
    rows = to_batch(batch, range(len(batch.responses)), torch.zeros(len(batch.responses)))
    t0 = time.perf_counter()
    logprobs_BL, entropy_BL = learner.score(rows)
    batch.learner_logprobs = [
        logprobs_BL[i, len(batch.prompt_of(i)) : len(batch.prompt_of(i)) + len(r)].tolist()
        for i, r in enumerate(batch.responses)
    ]
    diff = (logprobs_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL
    n = rows.mask_BL.sum().clamp(min=1)
    batch.meta.update(
        {
            "rollout/logprob_mismatch_mean": float(diff.sum() / n),
            "rollout/logprob_mismatch_max": float(diff.max()),
            "rollout/entropy": float((entropy_BL * rows.mask_BL).sum() / n),
            "time/score": time.perf_counter() - t0,
        }
    )


def train_on(
    batch: RolloutBatch,
    learner: Learner,
    loss_fn,
    engine: RolloutEngine | None,
    recipe: Recipe,
    recorder: Recorder,
    step: int,
) -> dict[str, float]:
    """All optimizer updates of one rollout batch; then the engine gets the new weights (waking up)."""
    advantages = grpo_advantages(batch.rewards_PG, recipe.algorithm.normalize_std, recipe.algorithm.std_eps)
    advantages = advantages.flatten()
    num_updates = recipe.updates_per_step
    per_update = len(batch.responses) // num_updates
    totals: dict[str, float] = {}
    for u in range(num_updates):
        rows = range(u * per_update, (u + 1) * per_update)
        mine = torch.tensor_split(torch.tensor(list(rows)), learner.world)[learner.rank].tolist()
        num_tokens = sum(len(batch.responses[i]) for i in rows)
        rows_batch = to_batch(batch, mine, advantages, recipe.algorithm.behaviour_logprobs)
        sample = record_sample(recorder, step, batch, list(rows), advantages, learner)
        t0 = time.perf_counter()
        m = learner.update(rows_batch, loss_fn, num_tokens)
        t1 = time.perf_counter()
        recorder.add(sample, m)
        if u == num_updates - 1:  # the engine samples again only after the step's last update
            sync_weights(learner, engine)
        m.update({"time/update": t1 - t0, "time/weight_sync": time.perf_counter() - t1})
        m["perf/learner_tokens_per_s"] = float(rows_batch.lengths_B.sum()) * learner.world / (t1 - t0)
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v / num_updates
    totals["optim/version"] = learner.version
    recorder.write(step)
    return totals


def record_sample(
    recorder: Recorder, step: int, batch: RolloutBatch, rows: list[int], advantages_N: torch.Tensor, learner
) -> Sample | None:
    """This rank's share of the update's recorded rows, scored by the learner just before the update."""
    if not recorder.due(step):
        return None
    picked, keep = recorder.pick(step, learner.version, rows, [len(batch.responses[i]) for i in rows])
    logprobs_BL, entropy_BL = learner.score(to_batch(batch, picked, advantages_N))
    if not keep:  # a copy scored so that every rank runs the same forwards
        return None
    spans = [(len(batch.prompt_of(i)), len(batch.responses[i])) for i in picked]

    def responses(values_BL: torch.Tensor) -> torch.Tensor:
        return torch.cat([values_BL[j, p : p + r] for j, (p, r) in enumerate(spans)] + [torch.zeros(0)])

    def packed(per_row: list[list[float]] | None) -> torch.Tensor:
        rows_ = [per_row[i] if per_row is not None else [0.0] * len(batch.responses[i]) for i in picked]
        return torch.tensor([x for row in rows_ for x in row], dtype=torch.float32)

    def per_row(value: int) -> torch.Tensor:
        return torch.full((len(picked),), value, dtype=torch.long)

    return Sample(
        behaviour_logprobs_N=packed(batch.behaviour_logprobs),
        learner_logprobs_N=packed(batch.learner_logprobs),
        logprobs_N=responses(logprobs_BL),
        entropy_N=responses(entropy_BL),
        lengths_R=torch.tensor([r for _, r in spans], dtype=torch.long),
        advantages_R=advantages_N[picked].float(),
        staleness_R=per_row(learner.version - batch.version),
        update_R=per_row(learner.version),
        row_R=torch.tensor(picked, dtype=torch.long),
        scored_R=torch.full((len(picked),), batch.learner_logprobs is not None),
    )


def sync_weights(learner: Learner, engine: RolloutEngine | None) -> None:
    """Stream the learner's weights into this rank's engine; every rank at once (a collective)."""
    if engine is not None:
        engine.push_weights(learner.hf_weights(engine.dtype), learner.version)


def to_batch(batch: RolloutBatch, rows, advantages_N: torch.Tensor, behaviour: str = "engine") -> Batch:
    """Right-padded tensors of the chosen rows (prompt + response) with their response mask.

    `behaviour` picks the behaviour logprobs: the engine's, or the learner's at the batch's version.
    """
    rows = list(rows)
    behaviour_logprobs = batch.behaviour_logprobs if behaviour == "engine" else batch.learner_logprobs
    seqs = [batch.prompt_of(i) + batch.responses[i] for i in rows]
    length = max((len(s) for s in seqs), default=1)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    behaviour = torch.zeros(len(rows), length)
    for j, i in enumerate(rows):
        p, r = len(batch.prompt_of(i)), len(batch.responses[i])
        tokens[j, : p + r] = torch.tensor(seqs[j])
        mask[j, p : p + r] = 1.0
        behaviour[j, p : p + r] = torch.tensor(behaviour_logprobs[i])
    return Batch(
        tokens_BL=tokens,
        mask_BL=mask,
        behaviour_logprobs_BL=behaviour,
        advantages_B=advantages_N[rows].float() if rows else torch.zeros(0),
        lengths_B=torch.tensor([len(s) for s in seqs], dtype=torch.long),
    )


def rollout_metrics(batch: RolloutBatch, staleness: int) -> dict[str, float]:
    lengths = torch.tensor([len(r) for r in batch.responses], dtype=torch.float32)
    return {
        "rollout/reward_mean": float(batch.rewards_PG.mean()),
        "rollout/solved_groups": float((batch.rewards_PG.max(dim=1).values > 0).float().mean()),
        "rollout/response_tokens_mean": float(lengths.mean()),
        "rollout/truncated_frac": 1.0 - sum(batch.finished) / len(batch.finished),
        "staleness/min": float(staleness),
        "staleness/mean": float(staleness),
        "staleness/max": float(staleness),
        "staleness/behaviour_version": float(batch.version),
        "perf/rollout_tokens_per_s": float(lengths.sum()) / max(batch.meta.get("time/generate", 0.0), 1e-9),
        **{k: v for k, v in batch.meta.items()},
    }


def _broadcast(batch: RolloutBatch | None) -> RolloutBatch:
    if dist.get_world_size() == 1:
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _seed(run_seed: int, index: int) -> int:
    return (run_seed * 1_000_003 + (index + 1_000) * 10_007) % 2**31


def _max_len(recipe: Recipe) -> int:
    return recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
