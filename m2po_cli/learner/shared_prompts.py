"""Shared prompts: a group's prompt computed once for all of its responses.

As right-padded rows, each of a group's n samples recomputes the prompt. Packed, the group is one
sequence `[prompt, response_1, ..., response_n]` in which a response attends to the prompt and,
causally, to itself, never to another response, and keeps the positions it has in its own row
(p, p + 1, ...). Every token then sees exactly the context it has in its row, so its logprob is the
row's (up to the order of float sums), while the prompt's activations are computed once and their
gradient is the sum of the n responses'. The forward computes `p + sum(r_i)` tokens per group
instead of `n (p + max r_i)` padded ones.

What it costs: attention takes a dense boolean mask, `[G, 1, T, T]` bytes for G groups packed to T
tokens, and a dense mask rules out FlashAttention (PyTorch picks the memory-efficient kernel on a
GPU, its CPU kernel here). So it pays where prompts are long against responses, as in the CPU
recipes: 55 prompt and ~20 response tokens, n = 8, a group is 215 tokens instead of 8 x 75 = 600
(2.8x fewer, before padding). At the 8B recipe's sizes (prompts of ~150 tokens, responses of up to
2,560, n = 8) a group packs to ~12k-20k tokens: 6-8% fewer tokens, for a mask of 150-420 MB per
group and no FlashAttention. `train.share_prompts = "auto"` therefore packs a batch only when that
saves at least `AUTO_MIN_SAVING` of its tokens and no packed group is longer than
`AUTO_MAX_GROUP_TOKENS` (a 64 MiB mask); the 8B recipe trains on rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from m2po_cli.learner.logprobs import ScoreRequest, scored_positions

AUTO_MIN_SAVING = 0.25
AUTO_MAX_GROUP_TOKENS = 8192


def prompt_groups(tokens_BL: Tensor, prompt_lengths_B: Tensor) -> list[Tensor]:
    """Row indices of each set of rows with the same prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, p in enumerate(prompt_lengths_B.tolist()):
        groups.setdefault(tuple(tokens_BL[b, :p].tolist()), []).append(b)
    return [torch.tensor(rows, dtype=torch.long) for rows in groups.values()]


def packed_lengths(lengths_B: Tensor, prompt_lengths_B: Tensor, groups: list[Tensor]) -> Tensor:
    """Tokens of each packed group: its prompt once, then every response."""
    return (
        torch.stack([(lengths_B[g] - prompt_lengths_B[g]).sum() + prompt_lengths_B[g[0]] for g in groups])
        if groups
        else torch.zeros(0, dtype=torch.long)
    )


def worth_sharing(lengths_B: Tensor, prompt_lengths_B: Tensor, groups: list[Tensor]) -> bool:
    """`auto`'s rule: packing saves at least `AUTO_MIN_SAVING` of the rows' tokens and no packed
    group is longer than `AUTO_MAX_GROUP_TOKENS`."""
    packed_G = packed_lengths(lengths_B, prompt_lengths_B, groups)
    if not packed_G.numel() or int(packed_G.max()) > AUTO_MAX_GROUP_TOKENS:
        return False
    return 1 - int(packed_G.sum()) / int(lengths_B.sum()) >= AUTO_MIN_SAVING


@dataclass
class SharedPrompts:
    """The rows of a micro-batch packed group by group (`pack`)."""

    tokens_GT: Tensor  # int64: each group's prompt then its responses, right-padded
    positions_GT: Tensor  # int64: each token's position in its own row
    allowed_G1TT: Tensor  # bool: query t may attend key u
    where_BL: Tensor  # int64: flat index into [G, T] of row b's token l (l < its length), else -1

    def score_request(self, tokens_BL: Tensor, mask_BL: Tensor, temperature: float, with_entropy: bool):
        """`score_request` of the rows, its positions read off the packed layout: the token at
        (b, l) is predicted where (b, l - 1) sits. Positions come in the rows' row-major order."""
        row_N, col_N = scored_positions(mask_BL).nonzero(as_tuple=True)
        return ScoreRequest(
            self.where_BL[row_N, col_N - 1], tokens_BL[row_N, col_N], temperature, with_entropy
        )


def pack(tokens_BL: Tensor, lengths_B: Tensor, prompt_lengths_B: Tensor) -> SharedPrompts:
    """Pack the rows group by group (`prompt_groups`). A group's padding tokens attend to its prompt
    and causally to each other, so no attention row is empty; they are never scored."""
    groups = prompt_groups(tokens_BL, prompt_lengths_B)
    packed_G = packed_lengths(lengths_B, prompt_lengths_B, groups)
    num_groups, length = len(groups), int(packed_G.max())
    tokens_GT = torch.zeros(num_groups, length, dtype=torch.long)
    positions_GT = torch.zeros(num_groups, length, dtype=torch.long)
    segment_GT = torch.zeros(num_groups, length, dtype=torch.long)  # 0: prompt; i: response i
    where_BL = torch.full(tokens_BL.shape, -1, dtype=torch.long)
    for g, rows in enumerate(groups):
        p = int(prompt_lengths_B[rows[0]])
        tokens_GT[g, :p] = tokens_BL[rows[0], :p]
        positions_GT[g, :p] = torch.arange(p)
        where_BL[rows, :p] = g * length + torch.arange(p)
        start = p
        for i, b in enumerate(rows.tolist(), start=1):
            r = int(lengths_B[b]) - p
            tokens_GT[g, start : start + r] = tokens_BL[b, p : p + r]
            positions_GT[g, start : start + r] = torch.arange(p, p + r)
            segment_GT[g, start : start + r] = i
            where_BL[b, p : p + r] = g * length + torch.arange(start, start + r)
            start += r
        segment_GT[g, start:] = len(rows) + 1
    causal_TT = torch.ones(length, length, dtype=torch.bool).tril()
    same_G1TT = segment_GT[:, :, None] == segment_GT[:, None, :]
    prompt_G1TT = (segment_GT == 0)[:, None, :].expand(-1, length, -1)
    allowed = causal_TT & (same_G1TT | prompt_G1TT)
    return SharedPrompts(tokens_GT, positions_GT, allowed[:, None], where_BL)
