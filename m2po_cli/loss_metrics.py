"""What the policy losses report: each micro-batch's additive token metrics (`token_metrics`, from
inside every loss) and the optimizer batch's ratio quantiles over every rank (`ratio_quantiles`, from
the learner and `m2po inspect`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.distributed import gather
from m2po_cli.run_dir import ABS_LOG_RATIO, CLIP_FRAC

Metrics = dict[str, Tensor]
NUM_SPLITS = 9  # token classes of `split_BT`: fresh, then replayed by age 1, 2-3, 4-7, ..., 128 and more
QUANTILES = {"p01": 0.01, "p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99}


@torch.no_grad()
def token_metrics(
    log_ratio_BT: Tensor,
    advantages_BT: Tensor,
    valid_BT: Tensor,
    clipped_BT: Tensor | None,
    denom: float | Tensor,
    split_BT: Tensor | None = None,
) -> Metrics:
    """Additive metrics of one micro-batch: raw (pre-clip) ratios, trust region, clipped or masked tokens.

    `log_ratio_BT` is 0 on padding. Fractions are of the optimizer batch's valid tokens (`denom`),
    so summing them over micro-batches and ranks gives the global fraction. `clipped_BT`: valid
    tokens whose gradient the loss removes (clipped or masked; all have A != 0), split by the sign
    of A into `_pos` and `_neg`; with `split_BT`, counted by token class too.
    """
    log_ratio_BT = log_ratio_BT.detach()
    sign_BT = advantages_BT.sign()
    metrics = {
        "loss/num_tokens": torch.count_nonzero(valid_BT),
        "loss/ratio_mean": torch.where(valid_BT, log_ratio_BT.exp(), 0.0).sum() / denom,
        ABS_LOG_RATIO: torch.where(valid_BT, log_ratio_BT.abs(), 0.0).sum() / denom,
        "loss/tr_frac": torch.count_nonzero(log_ratio_BT * sign_BT > 0) / denom,
    }
    if split_BT is not None:
        split_BT = split_BT.to(valid_BT.device)
        affected_BT = valid_BT & clipped_BT if clipped_BT is not None else torch.zeros_like(valid_BT)
        tokens_S = torch.bincount(split_BT[valid_BT], minlength=NUM_SPLITS)
        clipped_S = torch.bincount(split_BT[affected_BT], minlength=NUM_SPLITS)
        for k in range(NUM_SPLITS):
            metrics[f"loss/split_tokens_{k}"] = tokens_S[k]
            metrics[f"loss/split_clipped_{k}"] = clipped_S[k]
    if clipped_BT is None:
        zero = torch.zeros((), device=log_ratio_BT.device)
        return metrics | {CLIP_FRAC: zero, "loss/clip_frac_pos": zero, "loss/clip_frac_neg": zero}
    num_clipped = torch.count_nonzero(clipped_BT)
    num_clipped_pos = torch.count_nonzero(clipped_BT & (sign_BT > 0))
    metrics[CLIP_FRAC] = num_clipped / denom
    metrics["loss/clip_frac_pos"] = num_clipped_pos / denom
    metrics["loss/clip_frac_neg"] = (num_clipped - num_clipped_pos) / denom
    return metrics


@torch.no_grad()
def ratio_quantiles(log_ratio_BT: Tensor, mask_BT: Tensor, group: dist.ProcessGroup | None = None) -> Metrics:
    """Global raw token-ratio quantiles over the valid tokens of the whole optimizer batch.

    `loss/ratio_p01`, `_p10`, `_p50`, `_p90`, `_p99`, `_min`, `_max`: exact order statistics (the
    lower one when a quantile falls between two), the same for every loss type and equal on all
    ranks. Call once per optimizer step with the detached log-ratios of the rank's whole slice (for
    losses without a global pass, those collected from the micro-batch forwards, after backward).
    Empty when the batch has no valid token.
    """
    log_ratio_N = gather(log_ratio_BT.detach()[mask_BT.bool()].float(), group)
    n = log_ratio_N.numel()
    if n == 0:
        return {}
    lo, hi = torch.aminmax(log_ratio_N)
    metrics = {"loss/ratio_min": lo.exp(), "loss/ratio_max": hi.exp()}
    for name, q in QUANTILES.items():
        metrics[f"loss/ratio_{name}"] = torch.kthvalue(log_ratio_N, 1 + math.floor(q * (n - 1))).values.exp()
    return metrics
