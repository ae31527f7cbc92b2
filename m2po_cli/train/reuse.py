"""Rollout reuse (`[reuse]`): which rows each optimizer update of a step trains.

Chosen once from the recipe (`build_reuse`), behind one interface (`Reuse`: plan a step, after a
step, save, load). Off, a step's updates train its rollout batch's mini-batches in turn. `epochs`:
the mini-batches of every pass, `reuse.epochs` passes (TRL's `num_iterations`, verl's `ppo_epochs`);
both are `Passes`, which `m2po_cli.schedule` lays out. `replay`: the
learner keeps its rows of the last `reuse.buffer` rollout batches (`ReplayBuffer`), and every update
trains its fresh mini-batch plus groups drawn from them. Replayed rows keep their behaviour logprobs
and the versions that sampled them, so a replayed token's importance ratio is exact; the loss
decides what it contributes. Its age is the number of updates between its version and the update
that trains it, at most `reuse.max_age`.

The draw is the same on every rank: every rank holds the same table of the buffer's groups (their
policy version and mean |advantage|, reduced over the ranks when a batch enters the buffer), and an
update's generator is seeded by the run's seed, the step and the update alone, so a resumed run
draws the same groups. Each rank trains the rows it holds of the drawn groups (a group is replayed
whole, its rows where its fresh update dealt them); replayed groups take row numbers after the fresh
ones, one group's rows together, so M2PO's ties and shared prompts see them as a group.

Host memory per rank: the rows of `buffer` rollout batches, as the staleness FIFO holds them (about
4 bytes per token plus 9 per response token); docs/reuse.md works it out at the 8B recipe's sizes.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from m2po_cli.config import Recipe, ReuseConfig
from m2po_cli.distributed import all_reduce
from m2po_cli.learner.batch import Batch
from m2po_cli.loss_metrics import NUM_SPLITS
from m2po_cli.schedule import Schedule
from m2po_cli.train.fifo import unshared
from m2po_cli.train.packed import PackedRollouts

NO_VERSION = 2**62  # a group with no rows on a rank: the MIN over ranks ignores it


def age_bucket(age_B: Tensor) -> Tensor:
    """A replayed row's token class for the loss's metrics (`loss_metrics.NUM_SPLITS`): 1 for age 1, 2 for
    2-3, 3 for 4-7, ..., the last for 128 and older. Class 0 is fresh."""
    return (1 + torch.log2(age_B.clamp(min=1).double()).floor().long()).clamp(max=NUM_SPLITS - 1)


def bucket_label(k: int) -> str:
    """The ages of class `k` >= 1, as a metric name's suffix: `1`, `2-3`, ..., `128+`."""
    low = 2 ** (k - 1)
    return f"{low}+" if k == NUM_SPLITS - 1 else (f"{low}" if low == 1 else f"{low}-{2 * low - 1}")


@dataclass
class Entry:
    """One rollout batch in the buffer: this rank's rows, and the table of its groups (the same on
    every rank): each group's policy version (its oldest row's) and mean |advantage|."""

    step: int
    rows: PackedRollouts
    version_G: Tensor  # int64
    weight_G: Tensor  # float64: mean |advantage| over the group's rows


@dataclass
class StepPlan:
    """What a step trains on this rank: `batch` (its fresh rows, then the replayed ones), the local
    row indices of each update, and each row's token class (`age_bucket`; None without replay)."""

    batch: PackedRollouts
    updates: list[Tensor]
    split_B: Tensor | None

    def to_batch(self, index_K: Tensor, behaviour: str) -> Batch:
        """The learner's batch of the rows at `index_K`, with their token classes."""
        rows = self.batch.to_batch(index_K, behaviour)
        rows.split_B = None if self.split_B is None else self.split_B[index_K]
        return rows

    def replayed_R(self) -> Tensor:
        """Whether each response token's row is a replayed one."""
        if self.split_B is None:
            return torch.zeros(self.batch.version_R.numel(), dtype=torch.bool)
        return (self.split_B > 0).repeat_interleave(self.batch.response_len_B)


class Reuse(Protocol):
    """How a step's rows are trained: which rows each update takes, and what is kept between steps."""

    def plan(self, fresh: PackedRollouts, step: int, version: int) -> StepPlan:
        """This rank's rows for step `step`, whose first update is at policy `version`."""

    def after_step(self, fresh: PackedRollouts, step: int) -> dict[str, float]:
        """After the step's updates: keep what later steps reuse; the step's metrics. A collective."""

    def save(self, folder: Path, rank: int, world: int) -> None:
        """This rank's files in a checkpoint folder."""

    def load(self, folder: Path, rank: int, world: int) -> None:
        """Read back what `save` wrote."""


def build_reuse(recipe: Recipe) -> Reuse:
    """The recipe's reuse: the replay buffer, or passes over each batch (off: one; epochs: several)."""
    return ReplayBuffer(recipe) if recipe.reuse.mode == "replay" else Passes(Schedule.of(recipe))


def plan_passes(fresh: PackedRollouts, schedule: Schedule) -> StepPlan:
    """The fresh batch's mini-batches, once per pass; no token classes."""
    return StepPlan(fresh, schedule.updates(fresh.row_B), None)


class Passes:
    """Each step trains its own batch only, in `schedule.epochs` passes; nothing is kept."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def plan(self, fresh: PackedRollouts, step: int, version: int) -> StepPlan:
        return plan_passes(fresh, self.schedule)

    def after_step(self, fresh: PackedRollouts, step: int) -> dict[str, float]:
        return {}

    def save(self, folder: Path, rank: int, world: int) -> None:
        """Nothing to save."""

    def load(self, folder: Path, rank: int, world: int) -> None:
        """Nothing to load."""


class ReplayBuffer:
    """This rank's rows of the last `reuse.buffer` rollout batches, and the draws of a step's updates."""

    def __init__(self, recipe: Recipe):
        self.cfg: ReuseConfig = recipe.reuse
        self.schedule, self.seed = Schedule.of(recipe), recipe.run.seed
        self.entries: deque[Entry] = deque(maxlen=self.cfg.buffer)

    @property
    def num_bytes(self) -> int:
        return sum(e.rows.num_bytes for e in self.entries)

    def after_step(self, fresh: PackedRollouts, step: int) -> dict[str, float]:
        """Keep the step's fresh rows (`push`); the largest rank's buffer, `reuse/buffer_bytes`."""
        self.push(fresh, step)
        return {"reuse/buffer_bytes": float(all_reduce(torch.tensor(self.num_bytes), dist.ReduceOp.MAX))}

    def push(self, batch: PackedRollouts, step: int) -> None:
        """Keep this rank's rows of the batch step `step` trained (after its updates); the oldest batch
        leaves a full buffer. A collective: the group table is reduced over the ranks."""
        group_B = batch.row_B // self.schedule.n
        version_G = torch.full((self.schedule.prompts_per_step,), NO_VERSION, dtype=torch.long)
        version_G.scatter_reduce_(0, group_B, batch.version_B, reduce="amin")
        sums_G2 = torch.zeros(self.schedule.prompts_per_step, 2, dtype=torch.float64)
        sums_G2[:, 0].index_add_(0, group_B, batch.advantages_B.double().abs())
        sums_G2[:, 1].index_add_(0, group_B, torch.ones(batch.num_rows, dtype=torch.float64))
        version_G = all_reduce(version_G, dist.ReduceOp.MIN)
        sums_G2 = all_reduce(sums_G2, dist.ReduceOp.SUM)
        weight_G = sums_G2[:, 0] / sums_G2[:, 1].clamp(min=1)
        self.entries.append(Entry(step, batch, version_G, weight_G))

    def draw(self, step: int, update: int, version: int) -> list[tuple[int, int]]:
        """The groups update `update` of step `step` replays, trained at `version`: (entry, group)
        pairs, none older than `max_age` updates; the same on every rank."""
        pairs = [
            (e, g)
            for e, entry in enumerate(self.entries)
            for g in range(self.schedule.prompts_per_step)
            if entry.version_G[g] != NO_VERSION and version - int(entry.version_G[g]) <= self.cfg.max_age
        ]
        if self.cfg.rule == "advantage":
            pairs = [(e, g) for e, g in pairs if float(self.entries[e].weight_G[g]) > 0]
        want = min(len(pairs), round(self.cfg.replay * self.schedule.prompts_per_update))
        if not want:
            return []
        generator = torch.Generator().manual_seed(draw_seed(self.seed, step, update))
        if self.cfg.rule == "uniform":
            picked = torch.randperm(len(pairs), generator=generator)[:want].tolist()
        elif self.cfg.rule == "freshest":  # newest version first; then the newest batch, lowest group
            newest = [(-int(self.entries[e].version_G[g]), -e, g) for e, g in pairs]
            picked = sorted(range(len(pairs)), key=newest.__getitem__)[:want]
        else:
            weights = torch.tensor([float(self.entries[e].weight_G[g]) for e, g in pairs])
            picked = torch.multinomial(weights, want, replacement=False, generator=generator).tolist()
        return [pairs[i] for i in picked]

    def plan(self, fresh: PackedRollouts, step: int, version: int) -> StepPlan:
        """This rank's rows for the step: the fresh batch's mini-batches, each with the groups its
        update draws. Replayed group j of the step takes row numbers (P + j) * n + sample."""
        updates = self.schedule.updates(fresh.row_B)
        parts, split_parts, slot = (
            [fresh],
            [torch.zeros(fresh.num_rows, dtype=torch.long)],
            self.schedule.prompts_per_step,
        )
        offset = fresh.num_rows
        for u in range(len(updates)):
            mine = []
            for e, g in self.draw(step, u, version + u):
                entry = self.entries[e]
                index = ((entry.rows.row_B // self.schedule.n) == g).nonzero().squeeze(1)
                rows = entry.rows.take(index)
                rows.row_B = slot * self.schedule.n + rows.row_B % self.schedule.n
                parts.append(rows)
                split_parts.append(age_bucket(version + u - rows.version_B))  # ages >= 1
                mine.append(torch.arange(offset, offset + rows.num_rows))
                offset += rows.num_rows
                slot += 1
            if mine:
                updates[u] = torch.cat([updates[u], *mine])
        if len(parts) == 1:
            return StepPlan(fresh, updates, split_parts[0])
        # The learner's logprobs at the behaviour version go with the rows only where every row has
        # them (`algorithm.behaviour_logprobs = "learner"`; a recorded step's fresh rows): `cat`.
        batch = PackedRollouts.cat(parts, torch.cat([p.row_B for p in parts]))
        batch.version, batch.meta = fresh.version, fresh.meta
        return StepPlan(batch, updates, torch.cat(split_parts))

    # --- checkpoints ------------------------------------------------------------------------------

    def save(self, folder: Path, rank: int, world: int) -> None:
        """This rank's rows of every batch in the buffer, and the group tables, to one file."""
        tensors = {}
        for i, entry in enumerate(self.entries):
            tensors |= {f"{i}/{name}": t for name, t in entry.rows.tensors().items()}
            tensors[f"{i}/table/version_G"] = entry.version_G
            tensors[f"{i}/table/weight_G"] = entry.weight_G
        header = {
            "buffer": self.cfg.buffer,
            "steps": [e.step for e in self.entries],
            "versions": [e.rows.version for e in self.entries],
        }
        save_file(
            unshared(tensors),
            str(folder / buffer_name(rank, world)),
            metadata={"replay": json.dumps(header)},
        )

    def load(self, folder: Path, rank: int, world: int) -> None:
        """Read back this rank's file of `save`."""
        path = folder / buffer_name(rank, world)
        if not path.exists():
            raise ValueError(
                f"{folder}: no replay-buffer shard {path.name}; the checkpoint was saved without "
                "reuse.mode = replay, or with another number of ranks"
            )
        with safe_open(str(path), framework="pt") as f:
            header = json.loads(f.metadata()["replay"])
        tensors = load_file(str(path))
        self.entries.clear()
        for i, (step, version) in enumerate(zip(header["steps"], header["versions"], strict=True)):
            mine = {
                name.split("/", 1)[1]: t for name, t in tensors.items() if name.split("/", 1)[0] == str(i)
            }
            rows = PackedRollouts.from_tensors(
                version, {k: t for k, t in mine.items() if not k.startswith("table/")}, {}
            )
            self.entries.append(Entry(step, rows, mine["table/version_G"], mine["table/weight_G"]))


def draw_seed(seed: int, step: int, update: int) -> int:
    """The generator seed of one update's draw: the run's seed, the step and the update alone."""
    digest = hashlib.blake2b(repr(("replay", seed, step, update)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def buffer_name(rank: int, world: int) -> str:
    return f"replay-{rank:05d}-of-{world:05d}.safetensors"
