"""M2PO's global mask from the training forwards: a provisional mask first, corrected afterwards.

Within one optimizer update the weights do not change, so the logprobs of the training forwards
are exactly those a separate no-grad pass would give. `Learner.update` (way `correct_after`) runs
every micro-batch's forward and backward under a provisional keep mask M' (`provisional_keep`),
keeps the detached logprobs, computes the exact mask M over the whole batch from them (the loss's
`prepare`, all ranks), and then runs a correction forward and backward over only the rows where M
and M' differ, each cut after its last such token (a causal model's later tokens do not change
earlier logprobs), with the loss

    -(1/N) sum over those tokens of (M - M') w log pi,   w = r A from the first forward (constant),

whose gradient, added to the first one's, gives exactly that of `-(1/N) sum M r A`. The
correction's cost is its share f of the update's tokens (`correction_rows`): a forward and backward
over f of the tokens, against one no-grad forward over all of them for scoring first.

Shapes: `[B, L]` rows of prompt then response, as in `learner.py`; z = log r * sign(A) as in
`loss.toward_advantage`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m2po_cli.loss import toward_advantage

# The provisional mask also drops tokens with A > 0 and log r above this: so large a ratio is masked
# in practice, and a kept one would enter the gradient with weight r only to cancel, to rounding,
# against the correction (trust-region tokens with A < 0 have r < 1).
PROVISIONAL_MAX_LOG_RATIO = 4.0


def provisional_keep(
    log_ratio_BL: Tensor, advantages_BL: Tensor, valid_BL: Tensor, threshold: float
) -> Tensor:
    """Valid tokens whose z (formed as `prepare` forms it) is at most `threshold` (the previous
    update's mask threshold; inf for none), and at most PROVISIONAL_MAX_LOG_RATIO where A > 0."""
    z_BL = toward_advantage(torch.where(valid_BL, log_ratio_BL.float(), 0.0), advantages_BL)
    limit_BL = torch.where(advantages_BL > 0, min(threshold, PROVISIONAL_MAX_LOG_RATIO), threshold)
    return valid_BL & (z_BL <= limit_BL)


def correction_rows(keep_BL: Tensor, provisional_BL: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where the masks differ: (rows_K holding a changed token, cut_K = each one's length up to and
    including its last changed token, change_BL = M - M' in {-1, 0, 1} as float32)."""
    change_BL = keep_BL.float() - provisional_BL.float()
    rows_K = change_BL.any(dim=1).nonzero()[:, 0]
    cut_K = (change_BL[rows_K] != 0).cumsum(1).argmax(1) + 1  # the cumsum peaks first at the last change
    return rows_K, cut_K, change_BL


def correction_weights(
    change_BL: Tensor, log_ratio_BL: Tensor, advantages_BL: Tensor, num_tokens: int
) -> Tensor:
    """(M - M') r A / N on changed tokens, 0 elsewhere (never 0 * inf where r overflows)."""
    weight_BL = change_BL * log_ratio_BL.exp() * advantages_BL / max(num_tokens, 1)
    return torch.where(change_BL != 0, weight_BL, 0.0)
