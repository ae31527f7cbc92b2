"""Policy losses: pure tensor functions, one class per `[loss] type` of the recipe.

Each loss turns one micro-batch (current logprobs with grad, behaviour logprobs, advantages, mask)
into a scalar whose gradients, summed over micro-batches and data-parallel ranks, are those of the
token-mean objective of the whole optimizer batch: the per-token objective is summed over the
micro-batch's valid tokens and divided by `num_tokens`, the valid tokens of the whole optimizer
batch (all micro-batches, all ranks). What needs the whole batch at once (the M2PO mask) is computed
once per optimizer step by `prepare` and handed back to every micro-batch as `aux_BT`.

Shapes: B sequences (padded) x T response positions; `mask_BT` marks valid response tokens; r is
pi_theta / pi_behav per token, log r = logprobs - behaviour logprobs. Metrics returned by `__call__`
are additive (sums over this micro-batch divided by `num_tokens`, or counts), so the learner sums
them over micro-batches and ranks; metrics returned by `prepare` are global and equal on all ranks.

Sources: M2PO, Zheng, Zhao, Chen, "Prosperity before Collapse", arXiv 2510.01161 (Algorithm 1);
the released code, Infini-AI-Lab/M2PO `verl/trainer/ppo/core_algos.py` (`m2po_cap`); GSPO, Zheng et
al., arXiv 2507.18071; dual clip, Ye et al., arXiv 1912.09729. docs/losses.md compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.config.loss import GRPOLoss, GSPOLoss, LossConfig, M2POCapLoss, M2POLoss, NoTRLoss
from m2po_cli.loss_metrics import Metrics, token_metrics
from m2po_cli.second_moment import (
    effective_cap,
    m2po_cut,
    max_rest_z,
    released_cap,
    tied_leaving,
    trust_region_m2,
)


class MissingBehaviourLogprobs(ValueError):
    """The batch has no behaviour logprobs, so the importance ratio cannot be formed."""

    def __init__(self, loss_type: str):
        super().__init__(
            f"loss type {loss_type!r} needs the behaviour policy's logprob of every response token, and "
            "this batch has none. Have the rollout engine return the sampled tokens' logprobs (vLLM: "
            "SamplingParams(logprobs=0)) and keep them with the batch; they are never replaced by the "
            "current policy's logprobs."
        )


THRESHOLD = "m2po/threshold"  # M2PO's mask threshold, a metric of `prepare`


class PolicyLoss(Protocol):
    needs_global_pass: bool
    """True: `prepare` must see the log-ratios of the whole optimizer batch before any backward."""
    keep_mask_aux: bool
    """True: `prepare`'s result is a keep mask, and a kept token's gradient is that of r A / N
    whatever else is kept; so the backward may run under another mask and be corrected afterwards,
    token by token (`Learner.update`), starting from the mask's threshold (`mask_threshold`)."""

    def prepare(
        self,
        log_ratio_BT: Tensor,
        advantages_BT: Tensor,
        mask_BT: Tensor,
        group: dist.ProcessGroup | None = None,
        rows_B: Tensor | None = None,
    ) -> tuple[Tensor | None, Metrics]:
        """`rows_B`: the rows' numbers in the optimizer batch (an order shared by every rank, for
        M2PO's ties); None: their order here, for a batch held whole by one process."""

    def __call__(
        self,
        logprobs_BT: Tensor,
        behaviour_logprobs_BT: Tensor | None,
        advantages_BT: Tensor,
        mask_BT: Tensor,
        aux_BT: Tensor | None,
        num_tokens: int | Tensor,
        split_BT: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]:
        """`split_BT`: each token's class (int64, 0 to `NUM_SPLITS` - 1: fresh, or a replayed token's
        age bucket, `reuse.age_bucket`); with it the metrics count the valid and the clipped or
        masked tokens of every class (`loss/split_tokens_k`, `loss/split_clipped_k`)."""


def build_loss(cfg: LossConfig) -> PolicyLoss:
    """The loss the recipe's `[loss]` table selects, chosen once when the run starts."""
    return _LOSSES[type(cfg)](cfg)


# --- shared pieces -------------------------------------------------------------------------------


def require_behaviour_logprobs(behaviour_logprobs_BT: Tensor | None, loss_type: str) -> Tensor:
    """The behaviour logprobs, or MissingBehaviourLogprobs when the batch lacks them."""
    if behaviour_logprobs_BT is None:
        raise MissingBehaviourLogprobs(loss_type)
    return behaviour_logprobs_BT


def _log_ratio(
    logprobs_BT: Tensor, behaviour_logprobs_BT: Tensor | None, valid_BT: Tensor, loss_type: str
) -> Tensor:
    """log r with grad; 0 on padding, so garbage there can never reach the loss as inf or NaN."""
    behaviour_logprobs_BT = require_behaviour_logprobs(behaviour_logprobs_BT, loss_type)
    if behaviour_logprobs_BT.shape != logprobs_BT.shape:
        raise ValueError(
            f"behaviour logprobs have shape {tuple(behaviour_logprobs_BT.shape)}, current logprobs "
            f"{tuple(logprobs_BT.shape)}: they must cover the same response tokens"
        )
    return torch.where(valid_BT, logprobs_BT - behaviour_logprobs_BT, 0.0)


def toward_advantage(log_ratio_BT: Tensor, advantages_BT: Tensor) -> Tensor:
    """z = log r * sign(A): z > 0 exactly on trust-region tokens, where M2 = (log r)^2 = z^2.

    Trust-region tokens are the ones a PPO clip could act on: (A > 0, r > 1) or (A < 0, r < 1);
    zero-advantage tokens never are. Multiplying by the sign (not by A) cannot underflow.
    """
    return log_ratio_BT * advantages_BT.sign()


def _denominator(num_tokens: int | Tensor) -> float | Tensor:
    # An optimizer batch of empty responses has no tokens: its loss is 0, not 0 / 0.
    return num_tokens.clamp(min=1) if isinstance(num_tokens, Tensor) else float(max(num_tokens, 1))


# --- the losses ----------------------------------------------------------------------------------


class _NoGlobalPass:
    """For losses that need nothing global before the backward passes: `prepare` is a no-op."""

    needs_global_pass = False
    keep_mask_aux = False

    def prepare(
        self,
        log_ratio_BT: Tensor,
        advantages_BT: Tensor,
        mask_BT: Tensor,
        group: dist.ProcessGroup | None = None,
        rows_B: Tensor | None = None,
    ) -> tuple[Tensor | None, Metrics]:
        return None, {}


@dataclass(frozen=True)
class GRPO(_NoGlobalPass):
    """PPO clipped surrogate (GRPO): min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), token-mean.

    With `dual_clip` c, negative-advantage tokens take max(that, c A) (Ye et al. 2019). Objective:
    sum over valid tokens / num_tokens. The paper's GRPO baseline: eps 0.2 / 0.2, no dual clip.
    """

    cfg: GRPOLoss

    def __call__(
        self, logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT, aux_BT, num_tokens, split_BT=None
    ):
        valid_BT, denom = mask_BT.bool(), _denominator(num_tokens)
        log_ratio_BT = _log_ratio(logprobs_BT, behaviour_logprobs_BT, valid_BT, "grpo")
        ratio_BT = log_ratio_BT.exp()
        surrogate_BT = ratio_BT * advantages_BT
        clipped_surrogate_BT = ratio_BT.clamp(1 - self.cfg.eps_low, 1 + self.cfg.eps_high) * advantages_BT
        objective_BT = torch.minimum(surrogate_BT, clipped_surrogate_BT)
        clipped_BT = clipped_surrogate_BT < surrogate_BT  # never on padding: there r = 1
        metrics = {}
        if self.cfg.dual_clip is not None:
            floor_BT = self.cfg.dual_clip * advantages_BT
            dual_BT = valid_BT & (advantages_BT < 0) & (floor_BT > objective_BT)
            objective_BT = torch.where(dual_BT, floor_BT, objective_BT)
            clipped_BT = clipped_BT | dual_BT
            metrics["loss/dual_clip_frac"] = torch.count_nonzero(dual_BT) / denom
        loss = -torch.where(valid_BT, objective_BT, 0.0).sum() / denom
        return loss, token_metrics(
            log_ratio_BT, advantages_BT, valid_BT, clipped_BT, denom, split_BT
        ) | metrics


@dataclass(frozen=True)
class NoTR(_NoGlobalPass):
    """The plain importance-weighted objective r A, no trust region (the paper's "GRPO no TR")."""

    cfg: NoTRLoss

    def __call__(
        self, logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT, aux_BT, num_tokens, split_BT=None
    ):
        valid_BT, denom = mask_BT.bool(), _denominator(num_tokens)
        log_ratio_BT = _log_ratio(logprobs_BT, behaviour_logprobs_BT, valid_BT, "no_tr")
        loss = -(log_ratio_BT.exp() * torch.where(valid_BT, advantages_BT, 0.0)).sum() / denom
        return loss, token_metrics(log_ratio_BT, advantages_BT, valid_BT, None, denom, split_BT)


@dataclass(frozen=True)
class M2PO:
    """M2PO, the paper's Algorithm 1: J = (1 / N) sum_i M_i r_i A_i, no clip, no KL.

    `prepare` computes the mask M once per optimizer step over the whole batch (all micro-batches,
    all ranks; `m2po_cut`); N = `num_tokens` counts every valid token, masked ones included. Masked
    tokens get exactly zero gradient, kept ones the gradient of r A / N.
    """

    cfg: M2POLoss
    needs_global_pass = True
    keep_mask_aux = True

    def prepare(self, log_ratio_BT, advantages_BT, mask_BT, group=None, rows_B=None):
        """keep_BT (bool: valid and not masked, this rank's rows) and global metrics. Of the tokens
        equal to the threshold, those that leave are the earliest by (`rows_B`, position)."""
        if group is not None and dist.get_world_size(group) > 1 and rows_B is None:
            raise ValueError("m2po: prepare over several ranks needs the rows' numbers in the batch (rows_B)")
        valid_BT = mask_BT.bool()
        z_BT = toward_advantage(torch.where(valid_BT, log_ratio_BT.detach().float(), 0.0), advantages_BT)
        tr = trust_region_m2(z_BT, self.cfg.tau, group)
        threshold, num_masked, m2_before, m2_after = m2po_cut(tr, self.cfg.tau)
        keep_BT = valid_BT & (z_BT <= threshold)
        num_ties = int(num_masked - torch.count_nonzero(tr.top_N > threshold))
        if num_ties:
            rows_B = torch.arange(z_BT.shape[0]) if rows_B is None else rows_B
            keep_BT &= ~tied_leaving(z_BT, threshold, num_ties, rows_B, group)
        metrics = {
            "m2po/m2_before": m2_before,
            "m2po/m2_after": m2_after,
            "m2po/num_masked": num_masked,
            "m2po/num_trust_region": tr.num,
            THRESHOLD: threshold,
        }
        return keep_BT, metrics

    @staticmethod
    def mask_threshold(prepared: Metrics) -> float:
        """The z above which the mask `prepare` returned (with `prepared`, its metrics) leaves tokens
        out: the next update's provisional mask starts from it (`mask_correction`)."""
        return float(prepared[THRESHOLD])

    def __call__(
        self, logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT, aux_BT, num_tokens, split_BT=None
    ):
        if aux_BT is None:
            raise ValueError(
                "m2po: no mask; call prepare() on the whole optimizer batch before the first backward"
            )
        valid_BT, denom = mask_BT.bool(), _denominator(num_tokens)
        log_ratio_BT = _log_ratio(logprobs_BT, behaviour_logprobs_BT, valid_BT, "m2po")
        # Masked tokens take log r = 0 and A = 0: their gradient is an exact 0, never 0 * inf.
        ratio_BT = torch.where(aux_BT, log_ratio_BT, 0.0).exp()
        loss = -(ratio_BT * torch.where(aux_BT, advantages_BT, 0.0)).sum() / denom
        return loss, token_metrics(log_ratio_BT, advantages_BT, valid_BT, valid_BT & ~aux_BT, denom, split_BT)


@dataclass(frozen=True)
class M2POCap:
    """The released code's rule: PPO clip to [e^-c, e^c] with the cap c of `released_cap`, no dual clip.

    Only trust-region tokens at or beyond the cap are affected (the PPO min leaves the other
    quadrants alone): they keep the value e^(+-c) A and get zero gradient. Scope `micro_batch` (as
    released) computes c from each micro-batch's own tokens, so the result depends on the
    micro-batching; `global` computes one c in `prepare` over the whole optimizer batch. Normalised
    by `num_tokens` (the release: micro-batch token-mean times sequences / mini-batch sequences).
    """

    cfg: M2POCapLoss
    keep_mask_aux = False  # `prepare` gives the cap, and a capped token keeps its value

    @property
    def needs_global_pass(self) -> bool:
        return self.cfg.scope == "global"

    def prepare(self, log_ratio_BT, advantages_BT, mask_BT, group=None, rows_B=None):
        """Global scope: the cap broadcast to [B, T] and global metrics; micro-batch scope: nothing."""
        if self.cfg.scope == "micro_batch":
            return None, {}
        valid_BT = mask_BT.bool()
        z_BT = toward_advantage(torch.where(valid_BT, log_ratio_BT.detach().float(), 0.0), advantages_BT)
        cap, metrics, num_trust_region = self._cap(z_BT, group)
        return cap.expand(log_ratio_BT.shape), metrics | {"m2po/num_trust_region": num_trust_region}

    def _cap(self, z_BT: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Metrics, Tensor]:
        """The cap over the tokens of z_BT (and of the other ranks of `group`), its metrics, |T|."""
        tr = trust_region_m2(z_BT, self.cfg.tau, group)
        max_rest = max_rest_z(z_BT, tr.floor, group)
        cap, m2_before, m2_after = released_cap(tr, self.cfg.tau, max_rest)
        metrics = {
            "m2po/cap": effective_cap(cap, tr, max_rest),
            "m2po/m2_before": m2_before,
            "m2po/m2_after": m2_after,
        }
        return cap, metrics, tr.num

    def __call__(
        self, logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT, aux_BT, num_tokens, split_BT=None
    ):
        """Micro-batch scope: `m2po/cap`, `m2po/m2_before`, `m2po/m2_after` come weighted by the
        micro-batch's share of the batch's tokens, so their sums are token-weighted means."""
        valid_BT, denom = mask_BT.bool(), _denominator(num_tokens)
        log_ratio_BT = _log_ratio(logprobs_BT, behaviour_logprobs_BT, valid_BT, "m2po_cap")
        z_BT = toward_advantage(log_ratio_BT.detach(), advantages_BT)
        metrics = {}
        if self.cfg.scope == "micro_batch":
            cap, cap_metrics, num_trust_region = self._cap(z_BT.float(), None)
            share = torch.count_nonzero(valid_BT) / denom
            metrics = {name: value * share for name, value in cap_metrics.items()}
            metrics["m2po/num_trust_region"] = num_trust_region
        elif aux_BT is None:
            raise ValueError(
                "m2po_cap (scope global): no cap; call prepare() on the whole optimizer batch first"
            )
        else:
            cap = aux_BT
        clipped_BT = (z_BT > 0) & (z_BT >= cap)
        # A clipped token's value e^(+-c) A is a constant: zero gradient, as torch.clamp gives in the
        # release. For trust-region tokens sign(log r) = sign(A).
        clipped_log_ratio_BT = torch.where(clipped_BT, advantages_BT.sign() * cap, log_ratio_BT)
        loss = -(clipped_log_ratio_BT.exp() * torch.where(valid_BT, advantages_BT, 0.0)).sum() / denom
        return loss, token_metrics(
            log_ratio_BT, advantages_BT, valid_BT, clipped_BT, denom, split_BT
        ) | metrics


@dataclass(frozen=True)
class GSPO(_NoGlobalPass):
    """GSPO: sequence ratio s = exp(mean over the response of log r), objective min(s A, clip(s) A).

    Clip range [1 - eps_low, 1 + eps_high] (the GSPO paper: 3e-4 / 4e-4). Normalisation: every valid
    token carries its sequence's objective and the sum is divided by `num_tokens`, so sequences are
    weighted by length. The GSPO paper takes a plain mean over sequences; the two agree when all
    responses have the same length (the learner passes token counts, not sequence counts). Empty
    responses contribute nothing. Clipped tokens are the tokens of clipped sequences.
    """

    cfg: GSPOLoss

    def __call__(
        self, logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT, aux_BT, num_tokens, split_BT=None
    ):
        valid_BT, denom = mask_BT.bool(), _denominator(num_tokens)
        log_ratio_BT = _log_ratio(logprobs_BT, behaviour_logprobs_BT, valid_BT, "gspo")
        length_B1 = torch.count_nonzero(valid_BT, dim=-1).unsqueeze(-1)
        seq_ratio_B1 = (log_ratio_BT.sum(-1, keepdim=True) / length_B1.clamp(min=1)).exp()
        surrogate_BT = seq_ratio_B1 * advantages_BT
        clipped_surrogate_BT = seq_ratio_B1.clamp(1 - self.cfg.eps_low, 1 + self.cfg.eps_high) * advantages_BT
        objective_BT = torch.minimum(surrogate_BT, clipped_surrogate_BT)
        clipped_BT = valid_BT & (clipped_surrogate_BT < surrogate_BT)
        loss = -torch.where(valid_BT, objective_BT, 0.0).sum() / denom
        metrics = {"loss/seq_ratio_mean": (seq_ratio_B1.detach() * length_B1).sum() / denom}
        return loss, token_metrics(
            log_ratio_BT, advantages_BT, valid_BT, clipped_BT, denom, split_BT
        ) | metrics


_LOSSES = {GRPOLoss: GRPO, NoTRLoss: NoTR, M2POLoss: M2PO, M2POCapLoss: M2POCap, GSPOLoss: GSPO}
