"""One step's optimizer updates over a rollout batch, and the step's rollout and staleness metrics.

Shared by both rollout sources: `train_on` runs the updates of one rollout batch (this rank's rows)
and computes how stale every row is at the update that trains it, the one staleness definition of
the metrics and of the inspect records alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.config import Recipe
from m2po_cli.distributed import all_reduce, gather, transfer_device, world_group
from m2po_cli.learner.policy import Learner
from m2po_cli.loss_metrics import NUM_SPLITS
from m2po_cli.record import Recorder, Sample
from m2po_cli.rollout.episode import Episodes
from m2po_cli.run_dir import BEHAVIOUR_VERSION, REWARD, VERSION
from m2po_cli.train.packed import PackedRollouts
from m2po_cli.train.reuse import StepPlan, bucket_label


def train_on(
    plan: StepPlan,
    learner: Learner,
    loss_fn,
    sync: Callable[[Learner], None] | None,
    recipe: Recipe,
    recorder: Recorder,
    step: int,
) -> dict[str, float]:
    """All optimizer updates of one step (this rank's rows); `sync(learner)` after each may send the
    weights out (colocated: after the last one, waking the engine up). A collective.

    `plan` (`reuse`): the step's rows and the rows of each update. The loss of each update is the
    mean over its trained tokens, on every rank (`tokens_U`)."""
    batch, num_updates = plan.batch, len(plan.updates)
    trained_B = batch.trained_len_B
    counts_U = torch.tensor([float(trained_B[k].sum()) for k in plan.updates], dtype=torch.float64)
    tokens_U = all_reduce(counts_U, dist.ReduceOp.SUM)  # the global token count of each update
    totals: dict[str, float] = {}
    ages = TokenAges(plan, recipe)
    for u, index_K in enumerate(plan.updates):
        ages.count(batch.trained_index(index_K), learner.version)
        rows = plan.to_batch(index_K, recipe.algorithm.behaviour_logprobs)
        sample = record_sample(recorder, step, batch, index_K, learner, ages.staleness_R)
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
    totals[VERSION] = learner.version
    recorder.write(step)
    return ages.metrics(totals)


class TokenAges:
    """How stale each trained token is at the update that trains it: the number of updates between
    the version that sampled it and that update (in separate mode the tokens of one response may
    differ). The staleness metrics count every fresh token at each of its updates (up to the
    recipe's bound), the `reuse/` ones every replayed token (by age, up to `reuse.max_age`), when
    the plan replays rows."""

    def __init__(self, plan: StepPlan, recipe: Recipe):
        self.recipe, self.replays = recipe, plan.split_B is not None
        self.version_R, self.replayed_R = plan.batch.version_R, plan.replayed_R()
        self.staleness_R = torch.zeros(self.version_R.numel(), dtype=torch.long)  # at its last update
        self.fresh_S = torch.zeros(recipe.staleness_bound + 1, dtype=torch.float64)
        self.replayed_A = torch.zeros(recipe.reuse.max_age + 1, dtype=torch.float64)

    def count(self, tokens: Tensor, version: int) -> None:
        """The trained tokens at positions `tokens` of the `_R` tensors, trained at `version`."""
        self.staleness_R[tokens] = version - self.version_R[tokens].long()
        stale_R, old_R = self.staleness_R[tokens], self.replayed_R[tokens]
        bound, max_age = self.recipe.staleness_bound, self.recipe.reuse.max_age
        self.fresh_S += torch.bincount(stale_R[~old_R].clamp(0, bound), minlength=bound + 1)
        self.replayed_A += torch.bincount(stale_R[old_R].clamp(0, max_age), minlength=max_age + 1)

    def metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's metrics with the staleness (and replay) ones. A collective."""
        metrics = totals | staleness_metrics(self.fresh_S, self.recipe)
        return reuse_metrics(metrics, self.replayed_A) if self.replays else metrics


def staleness_metrics(hist_S: torch.Tensor, recipe: Recipe) -> dict[str, float]:
    """How many updates old the policy that sampled each fresh response token was at the update that
    trained it, over every rank's tokens (`hist_S`: this rank's token counts by staleness, up to the
    bound): min, mean, max, and in bounded mode the histogram. A collective."""
    bound = recipe.staleness_bound
    hist_S = all_reduce(hist_S, dist.ReduceOp.SUM)
    seen = hist_S.nonzero().squeeze(1)
    if not seen.numel():
        return {}
    m = {
        "staleness/min": float(seen.min()),
        "staleness/mean": float((hist_S * torch.arange(bound + 1)).sum() / hist_S.sum()),
        "staleness/max": float(seen.max()),
    }
    if recipe.bounded_staleness:
        m.update({f"staleness/hist_{k}": float(count) for k, count in enumerate(hist_S.tolist())})
    return m


def reuse_metrics(metrics: dict[str, float], hist_A: torch.Tensor) -> dict[str, float]:
    """Replay's metrics of a step, from the loss's per-class counts (`loss/split_*`, summed over the
    step's updates and every rank; replaced here) and this rank's replayed tokens by age (`hist_A`):
    `reuse/replayed_token_frac` (of the trained tokens), `reuse/age_mean`, `_min`, `_max`, the clipped or
    masked share of fresh tokens (`reuse/clip_frac_fresh`) and of replayed ones by age
    (`reuse/clip_frac_age_<ages>`, where the step trained some), and `reuse/age_hist_<ages>` (the
    replayed tokens' share in each age class). A collective."""
    counts = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith("loss/split_")]}
    tokens_S = [counts[f"loss/split_tokens_{k}"] for k in range(NUM_SPLITS)]
    clipped_S = [counts[f"loss/split_clipped_{k}"] for k in range(NUM_SPLITS)]
    hist_A = all_reduce(hist_A, dist.ReduceOp.SUM)
    replayed = sum(tokens_S[1:])  # the loss's counts are means over the step's updates
    out = {"reuse/replayed_token_frac": replayed / max(sum(tokens_S), 1e-9)}
    if hist_A.sum():
        ages = torch.arange(hist_A.numel(), dtype=torch.float64)
        out["reuse/age_mean"] = float((hist_A * ages).sum() / hist_A.sum())
        out["reuse/age_min"] = float(hist_A.nonzero().min())
        out["reuse/age_max"] = float(hist_A.nonzero().max())
    if tokens_S[0]:
        out["reuse/clip_frac_fresh"] = clipped_S[0] / tokens_S[0]
    for k in range(1, NUM_SPLITS):
        if tokens_S[k]:
            out[f"reuse/clip_frac_age_{bucket_label(k)}"] = clipped_S[k] / tokens_S[k]
            out[f"reuse/age_hist_{bucket_label(k)}"] = tokens_S[k] / replayed
    return metrics | out


def record_sample(
    recorder: Recorder,
    step: int,
    batch: PackedRollouts,
    index_K: torch.Tensor,
    learner: Learner,
    staleness_R: torch.Tensor,
) -> Sample | None:
    """This rank's rows among the update's recorded ones, scored by the learner just before the
    update; each token with its staleness at this update (`staleness_R`, from `train_on`).

    The recorder chooses among all rows of the update (their ids and lengths gathered from every
    rank); each rank scores the chosen rows it holds. A collective.
    """
    if not recorder.due(step):
        return None
    group, device = world_group(), transfer_device()
    rows_N = gather(batch.row_B[index_K], group, via=device)  # in rank order, which is row order
    lengths_N = gather(batch.trained_len_B[index_K], group, via=device)
    picked, _ = recorder.pick(step, learner.version, rows_N.tolist(), lengths_N.tolist())
    chosen_N = gather(torch.tensor(picked, dtype=torch.long), group, via=device)
    mine_K = index_K[torch.isin(batch.row_B[index_K], chosen_N)]
    padded = batch.to_batch(mine_K)
    logprobs_BL, entropy_BL = learner.score(padded, with_entropy=True)  # every rank, rows or not
    if not mine_K.numel():
        return None
    rows, mask_BL = batch.take(mine_K), padded.mask_BL.bool()

    def per_row(value: int) -> torch.Tensor:
        return torch.full((rows.num_rows,), value, dtype=torch.long)

    scored = bool(batch.learner_R.numel())  # every row was scored at its behaviour version
    behaviour_N = rows.behaviour_R[rows.trained_R]
    return Sample(
        behaviour_logprobs_N=behaviour_N,
        learner_logprobs_N=rows.learner_R[rows.trained_R] if scored else torch.zeros_like(behaviour_N),
        logprobs_N=logprobs_BL[mask_BL],
        entropy_N=entropy_BL[mask_BL],
        staleness_N=staleness_R[batch.trained_index(mine_K)],
        turn_N=batch.turn_R[batch.trained_index(mine_K)],
        lengths_R=rows.trained_len_B,
        advantages_R=rows.advantages_B,
        update_R=per_row(learner.version),
        row_R=rows.row_B,
        scored_R=torch.full((rows.num_rows,), scored),
    )


def rollout_metrics(batch: PackedRollouts, episodes: Episodes | None = None) -> dict[str, float]:
    """Metrics of the whole rollout batch (a collective: sums over every rank's rows), with the
    source's own (`batch.meta`). Multi-turn `episodes` add the mean turns, tool calls and failed
    calls, model (trained) and environment tokens per episode (`env/`)."""
    lengths_B = batch.trained_len_B.double()
    columns = [
        torch.ones(batch.num_rows, dtype=torch.float64),
        batch.rewards_B.double(),
        batch.solved_B.double(),
        lengths_B,
        batch.finished_B.double(),
    ]
    if episodes is not None and episodes.multi_turn:
        context_B = batch.response_len_B.double() - lengths_B
        calls = [batch.tool_calls_B.double(), batch.tool_failures_B.double()]
        columns += [batch.turns_B.double(), *calls, context_B]
    sums = all_reduce(torch.stack([c.sum() for c in columns]).double(), dist.ReduceOp.SUM).tolist()
    num_rows, rewards, solved, tokens, finished, *per_episode = sums
    num_rows = max(num_rows, 1.0)
    env = {}
    if per_episode:
        keys = ("turns_mean", "tool_calls_mean", "tool_failures_mean", "env_tokens_mean")
        env = {f"env/{k}": v / num_rows for k, v in zip(keys, per_episode, strict=True)}
        env["env/model_tokens_mean"] = tokens / num_rows
    return {
        REWARD: rewards / num_rows,
        "rollout/solved_groups": solved / num_rows,  # every row of a group carries its group's flag
        "rollout/response_tokens_mean": tokens / num_rows,
        "rollout/truncated_frac": 1.0 - finished / num_rows,
        BEHAVIOUR_VERSION: float(batch.version),
        **env,
        **batch.meta,
    }
