"""Which optimizer update trains which rows, and where a step starts: the one answer the producer's
admission, rollout reuse, the packer's deal and the loop share.

A step takes `prompts_per_step` (P) prompts of `n` samples each and trains them in mini-batches of
`prompts_per_update` (B) prompts, one optimizer update each, in `epochs` passes over the step's
prompts (`reuse.epochs`; one otherwise): `updates_per_step` = epochs x P / B updates. Rows are
numbered prompt-major within a step (prompt p, sample g -> p * n + g), so a row's mini-batch is
`row // (B * n)`. Groups are counted in the order the learner takes them, across steps: the group
taken `index`-th is trained by update `update_of(index, pass)` of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from m2po_cli.config import Recipe


@dataclass(frozen=True)
class Schedule:
    prompts_per_step: int  # P
    prompts_per_update: int  # B, dividing P
    n: int  # samples (rows) per prompt
    epochs: int = 1  # passes over each step's prompts

    def __post_init__(self) -> None:
        if self.prompts_per_step % self.prompts_per_update:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of prompts_per_update "
                f"({self.prompts_per_update})"
            )

    @classmethod
    def of(cls, recipe: Recipe) -> Schedule:
        r = recipe.rollout
        return cls(r.prompts_per_step, recipe.prompts_per_update, r.n, recipe.reuse.epochs_per_batch)

    @property
    def mini_batches(self) -> int:
        """Optimizer updates per pass over a step's prompts."""
        return self.prompts_per_step // self.prompts_per_update

    @property
    def updates_per_step(self) -> int:
        return self.mini_batches * self.epochs

    @property
    def rows_per_update(self) -> int:
        return self.prompts_per_update * self.n

    def update_of(self, index: int, epoch: int) -> int:
        """The update (counted from 0 over the run) of pass `epoch` that trains the group taken
        `index`-th."""
        step, place = divmod(index, self.prompts_per_step)
        return (step * self.epochs + epoch) * self.mini_batches + place // self.prompts_per_update

    def first_update(self, index: int) -> int:
        return self.update_of(index, 0)

    def last_update(self, index: int) -> int:
        return self.update_of(index, self.epochs - 1)

    def step_start(self, version: int) -> int:
        """The groups taken before the step whose first update is `version`."""
        return version // self.updates_per_step * self.prompts_per_step

    def mini_batch_of(self, row_B: Tensor) -> Tensor:
        """Each row's mini-batch in its step, from its row number."""
        return row_B // self.rows_per_update

    def updates(self, row_B: Tensor) -> list[Tensor]:
        """The local positions of the rows (numbered `row_B`) each update of a step trains: the
        mini-batches in turn, once per pass."""
        mini_batch_B = self.mini_batch_of(row_B)
        once = [(mini_batch_B == u).nonzero().squeeze(1) for u in range(self.mini_batches)]
        return once * self.epochs
