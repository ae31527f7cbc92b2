"""A training batch: one rank's rows of prompt then response, right-padded, and its micro-batches.

Shapes: `[B, L]` rows, prompt then response; `mask_BL` marks the response tokens the loss scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from m2po_cli.learner import shared_prompts

if TYPE_CHECKING:
    from m2po_cli.config import TrainConfig


def rows(optional: bool = False):
    """A per-row field of `Batch` (`[B]`); an `optional` one may be None."""
    return field(default=None, metadata={"axis": "B"}) if optional else field(metadata={"axis": "B"})


def positions():
    """A per-position field of `Batch` (`[B, L]`)."""
    return field(metadata={"axis": "BL"})


@dataclass
class Batch:
    """One rank's rows of a training batch, right-padded to the longest row."""

    tokens_BL: torch.Tensor = positions()  # int64
    mask_BL: torch.Tensor = positions()  # float32, 1 on the trained response tokens
    behaviour_logprobs_BL: torch.Tensor = positions()  # float32, 0 off the mask
    advantages_B: torch.Tensor = rows()  # float32
    lengths_B: torch.Tensor = rows()  # int64, prompt + response tokens of each row
    # int64, each row's number in its rollout batch: an order every rank shares (M2PO's ties); None
    # for rows held whole by one process, whose order here is the order
    rows_B: torch.Tensor | None = rows(optional=True)
    # int64, the prompt tokens each row starts with: rows with the same prompt may share its
    # computation (`shared_prompts`); None: every row is computed whole
    prompt_lengths_B: torch.Tensor | None = rows(optional=True)
    # int64, each row's token class for the loss's metrics (`loss_metrics.NUM_SPLITS`: fresh, or a replayed
    # row's age bucket); None: no split
    split_B: torch.Tensor | None = rows(optional=True)

    def take(self, index_K: torch.Tensor) -> Batch:
        """Rows at `index_K`, trimmed to their own longest row (no rows: `[0, 1]`, as `to_batch`)."""
        length = int(self.lengths_B[index_K].max()) if index_K.numel() else 1
        taken = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = value[index_K, :length] if f.metadata["axis"] == "BL" else value[index_K]
            taken[f.name] = value
        return Batch(**taken)

    @property
    def num_rows(self) -> int:
        return self.tokens_BL.shape[0]

    @property
    def advantages_BL(self) -> torch.Tensor:
        """Each row's sequence advantage, repeated along its tokens."""
        return self.advantages_B[:, None].expand_as(self.mask_BL)


def micro_batches(
    lengths_B: torch.Tensor, max_rows: int, max_tokens: int, members: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Row indices of each micro-batch: rows sorted longest first, cut greedily so that a
    micro-batch has at most `max_rows` rows and, padded to its longest, at most `max_tokens` tokens
    (0: no token budget; a row longer than the budget goes alone).

    With `members`, the items cut are sets of rows that go together (a packed group of
    `shared_prompts`): `lengths_B` holds each set's tokens, and a set counts as its rows."""
    order_B = torch.sort(lengths_B, descending=True, stable=True).indices
    sorted_lengths = lengths_B[order_B].tolist()
    rows = [1] * len(sorted_lengths) if members is None else [len(members[i]) for i in order_B.tolist()]
    cuts = [0]
    count = rows[0] if rows else 0
    for i in range(1, len(sorted_lengths)):
        count += rows[i]  # rows if item i joins; the first item of a micro-batch is its longest
        if count > max_rows or (max_tokens and (i - cuts[-1] + 1) * sorted_lengths[cuts[-1]] > max_tokens):
            cuts.append(i)
            count = rows[i]
    ends = cuts[1:] + [len(sorted_lengths)]
    parts = [order_B[a:b] for a, b in zip(cuts, ends, strict=True)] if sorted_lengths else []
    if members is None:
        return parts
    return [torch.cat([members[i] for i in part.tolist()]) for part in parts]


def padding_overhead(lengths_B: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """Padded tokens computed over real tokens, for the micro-batches `parts`."""
    padded = sum(len(p) * int(lengths_B[p].max()) for p in parts if len(p))
    return padded / max(int(lengths_B.sum()), 1)


# A micro-batch for a rank with none left: one 2-token row whose one scored token has no weight.
IDLE = Batch(
    torch.zeros(1, 2, dtype=torch.long),
    torch.tensor([[0.0, 1.0]]),
    torch.zeros(1, 2),
    torch.zeros(1),
    torch.tensor([2]),
)


def plan_micro_batches(batch: Batch, t: TrainConfig) -> tuple[Batch, list[torch.Tensor]]:
    """This rank's micro-batches as row indices into the returned batch. Rows that share their
    prompt (`train.share_prompts`; `auto`: where `shared_prompts.worth_sharing`) go to one
    micro-batch and keep `prompt_lengths_B`; otherwise it is dropped."""
    groups = None
    if batch.prompt_lengths_B is not None and t.share_prompts != "off" and batch.num_rows:
        groups = shared_prompts.prompt_groups(batch.tokens_BL, batch.prompt_lengths_B)
        if t.share_prompts == "auto" and not shared_prompts.worth_sharing(
            batch.lengths_B, batch.prompt_lengths_B, groups
        ):
            groups = None
    if groups is None:
        batch = replace(batch, prompt_lengths_B=None)
        parts = micro_batches(batch.lengths_B, t.micro_batch_sequences, t.micro_batch_tokens)
    else:
        lengths_G = shared_prompts.packed_lengths(batch.lengths_B, batch.prompt_lengths_B, groups)
        parts = micro_batches(lengths_G, t.micro_batch_sequences, t.micro_batch_tokens, groups)
    return batch, parts
