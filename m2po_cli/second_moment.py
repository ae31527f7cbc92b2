"""M2PO's second-moment rules over a batch's trust region: Algorithm 1's mask and the released cap.

M2 = (log r)^2 is the second moment the paper bounds; the trust region is the tokens a PPO clip
could act on, z = log r * sign(A) > 0 (`loss.toward_advantage`). Both rules need the trust-region M2
of the whole optimizer batch, over every rank, before any backward: `trust_region_m2` reduces it,
and each rule searches it without a loop over tokens or a sort of the whole batch (`search`).

Sources: M2PO, Zheng, Zhao, Chen, "Prosperity before Collapse", arXiv 2510.01161 (Algorithm 1);
the released code, Infini-AI-Lab/M2PO `verl/trainer/ppo/core_algos.py` (`m2po_cap`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.distributed import all_reduce_group, gather

NUM_BINS = 1024  # the M2 rules bin the trust-region M2 above tau into this many bins (by log z)


class TrustRegionM2(NamedTuple):
    """The trust-region M2 of a batch, reduced over ranks: what both M2 rules need.

    Only tokens with M2 > tau are ever masked or decide the cap, so only the trust-region tokens
    with z > `floor` (just below sqrt(tau)) are gathered and searched (`search`); the others, the
    rest, enter through their count and M2 sum.
    """

    top_N: Tensor  # z of the trust-region tokens with z > floor (float32, unordered, all ranks)
    num_rest: Tensor  # number of the other trust-region tokens, 0 < z <= floor (float64)
    m2_rest: Tensor  # their sum of M2 = z^2 (float64; the squares are exact)
    floor: float  # < sqrt(tau)

    @property
    def num(self) -> Tensor:
        return self.num_rest + self.top_N.numel()

    @property
    def m2_mean(self) -> Tensor:
        """Mean M2 over the trust region (0 if empty)."""
        return (self.m2_rest + self.top_N.double().square().sum()) / self.num.clamp(min=1)


def trust_region_m2(z_BT: Tensor, tau: float, group: dist.ProcessGroup | None = None) -> TrustRegionM2:
    """Summarise z = log r * sign(A) (float32, 0 on padding; see `toward_advantage`) over the batch."""
    floor = float(torch.tensor(math.sqrt(tau), dtype=torch.float32)) * (1 - 2**-10)
    top_BT = z_BT > floor
    rest_N = z_BT.clamp(min=0).masked_fill_(top_BT, 0.0).reshape(-1).double()
    stats = torch.stack([torch.count_nonzero(rest_N).double(), torch.dot(rest_N, rest_N)])
    num_rest, m2_rest = all_reduce_group(stats, dist.ReduceOp.SUM, group)
    return TrustRegionM2(gather(z_BT[top_BT], group), num_rest, m2_rest, floor)


def search(tr: TrustRegionM2, stop, below: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first position, in the descending order of the top values, where a rule may stop.

    Position i means "the i largest have left" (i = 0..n_top). `stop(position_P, left_P, m2_P)`
    gets, for some positions, the M2 sum of the tokens left (the rest included) and the M2 of the
    i-th value (the largest one left; `below` past the last top value), and says where the rule may
    stop; it must hold from some position on, as both rules' conditions do. The top values are
    binned by log z into NUM_BINS bins; the rule is first tried at the bin boundaries (all at once),
    then inside the one bin where it starts to hold, whose values alone are sorted. No loop over tokens, and no sort of the whole batch. Sums
    run from the small values up, so nothing cancels.

    Returns the position i, the z at i, the M2 sum left at i, and the M2 at i.
    """
    top_N, n_top = tr.top_N, tr.top_N.numel()
    if n_top == 0:
        return tr.num_rest.new_zeros((), dtype=torch.long), below, tr.m2_rest, below.double().square()
    num_bins = min(NUM_BINS, n_top)
    log_floor = math.log(tr.floor)
    scale = num_bins / (top_N.max().log() - log_floor).clamp(min=1e-6)
    bin_N = ((top_N.log() - log_floor) * scale).clamp(0, num_bins - 1).long()  # monotone in z
    m2_N = top_N.double().square()
    count_B = torch.bincount(bin_N, minlength=num_bins)
    position_Q = n_top - (count_B.cumsum(0) - count_B)  # boundary q: the values in bins >= q left
    left_Q = tr.m2_rest + torch.bincount(bin_N, weights=m2_N, minlength=num_bins).cumsum(0)
    left_Q = torch.cat([tr.m2_rest.reshape(1), left_Q[:-1]])  # M2 in bins < q, and the rest
    max_B = top_N.new_full((num_bins,), -math.inf).scatter_reduce(0, bin_N, top_N, "amax")
    # The largest z below boundary q: in the bins under q, else `below`.
    next_Q = torch.cat([below.reshape(1), max_B.cummax(0).values[:-1]]).maximum(below)
    stop_Q = stop(position_Q.double(), left_Q, next_Q.double().square())
    q = torch.where(stop_Q, torch.arange(num_bins, device=top_N.device), 0).max()  # the highest boundary
    # Inside bin q: its values sorted, then the largest value below it.
    z_K1 = torch.cat([torch.sort(top_N[bin_N == q], descending=True).values, next_Q[q].reshape(1)])
    m2_K1 = z_K1.double().square()
    left_K1 = left_Q[q] + torch.cat([m2_K1[:-1].flip(0).cumsum(0).flip(0), m2_K1.new_zeros(1)])
    position_K1 = position_Q[q] - count_B[q] + torch.arange(z_K1.numel(), device=top_N.device)
    stop_K1 = stop(position_K1.double(), left_K1, m2_K1)
    stop_K1[-1] = True  # the boundary below bin q, where the rule holds
    j = torch.argmax(stop_K1.to(torch.uint8))  # the first position where it holds
    return position_K1[j], z_K1[j], left_K1[j], m2_K1[j]


def m2po_cut(tr: TrustRegionM2, tau: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Algorithm 1 of the paper, vectorised: binned sums over the trust-region M2.

    While the mean M2 over the trust-region tokens T exceeds tau, the token with the largest M2
    leaves T, one at a time. After the i largest left, the mean is (M2 sum left) / (|T| - i), so the
    loop stops at the first i whose mean is <= tau (i = |T|, everything masked, if none is). Tokens
    with M2 <= tau are never reached: the mean cannot exceed the largest value left.
    Ties: i may fall inside a run of equal values (the 8 samples of a prompt share prefixes, and
    identical prefixes give identical log-ratios). Then only some of the tokens equal to the
    threshold leave: the `num_masked - (number of z > threshold)` earliest in the optimizer batch,
    by row then position (`tied_leaving`), so the mask does not depend on the micro-batching or the
    number of ranks (up to the rounding of the float64 M2 sums, accumulated in an order that does:
    it could only matter for a mean within ~1e-15 of tau).

    Returns (threshold, num_masked, m2_before, m2_after): the z of the largest token kept (`below`,
    the floor, when every top value leaves), so every token with z > threshold is masked and some
    with z == threshold may be; the mean M2 over T before and after masking (float64; 0 over an
    empty set).
    """

    def mean_left(position_P: Tensor, left_P: Tensor) -> Tensor:
        kept_P = tr.num - position_P
        return torch.where(kept_P > 0, left_P / kept_P.clamp(min=1), 0.0)

    def stop(position_P: Tensor, left_P: Tensor, m2_P: Tensor) -> Tensor:
        return mean_left(position_P, left_P) <= tau

    # Past the last top value, any z in [largest rest, floor] masks exactly the top values.
    below = tr.top_N.new_full((), tr.floor)
    position, threshold, left, _ = search(tr, stop, below)
    return threshold, position, tr.m2_mean, mean_left(position.double(), left)


def tied_leaving(
    z_BT: Tensor, threshold: Tensor, num_ties: int, rows_B: Tensor, group: dist.ProcessGroup | None
) -> Tensor:
    """Which of this rank's tokens with z == threshold leave (`m2po_cut`): the `num_ties` earliest of
    all such tokens on every rank of `group`, ordered by the row's number in the optimizer batch
    (`rows_B`, this rank's rows) then the position in the row. `[B, T]` bool. A collective: the keys
    of the tied tokens alone are gathered (usually a handful; at most a few groups' shared
    prefixes)."""
    row_N, position_N = (z_BT == threshold).nonzero(as_tuple=True)
    key_N = rows_B.to(row_N.device)[row_N] * 2**32 + position_N  # row, then position
    last = torch.sort(gather(key_N, group)).values[num_ties - 1]
    leaving_BT = torch.zeros_like(z_BT, dtype=torch.bool)
    leave_N = key_N <= last
    leaving_BT[row_N[leave_N], position_N[leave_N]] = True
    return leaving_BT


def released_cap(tr: TrustRegionM2, tau: float, max_rest: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The released code's cap (`kpo_clip_harmful_tokens`), vectorised.

    If the mean M2 over T is <= tau: no clip (cap = inf). Otherwise the cap is searched over the
    tokens' own values: with M2 ascending, k is the first index at which the capped mean
    (1/|T|) sum_i min(M2_i, M2_(k)) reaches tau, and c^2 = M2_(k-1) (c = 0 if k = 0): the largest
    M2 whose capped mean stays below tau. The code subtracts 1e-12 from c^2, so tokens with |log r|
    equal to c are clipped too; we keep that and drop its other 1e-12 slacks. `max_rest`: the
    largest z of the trust-region tokens not in `tr.top_N` (0 if none).

    Returns (cap, m2_before, m2_after): trust-region tokens with z >= cap are clipped; the mean M2
    over T before, and after capping (float64; 0 over an empty set).
    """
    n = tr.num.clamp(min=1)

    def capped_mean(position_P: Tensor, left_P: Tensor, m2_P: Tensor) -> Tensor:
        return (position_P * m2_P + left_P) / n  # the i largest capped at the value at i

    def stop(position_P: Tensor, left_P: Tensor, m2_P: Tensor) -> Tensor:
        # Descending, the cap is the first value whose capped mean is below tau.
        return capped_mean(position_P, left_P, m2_P) < tau

    position, cap, left, m2 = search(tr, stop, max_rest)
    m2_before = tr.m2_mean
    over = m2_before > tau
    m2_after = torch.where(over, capped_mean(position.double(), left, m2), m2_before)
    return torch.where(over, cap, math.inf), m2_before, m2_after


def max_rest_z(z_BT: Tensor, floor: float, group: dist.ProcessGroup | None) -> Tensor:
    """The largest z in (0, floor] over the batch, 0 if none: the cap below every top value."""
    # Tokens outside the trust region (z <= 0: padding, A = 0, or r on the wrong side) have no M2 to
    # cap; keeping their negative z would make the "largest" negative when T is empty.
    rest_BT = torch.where((z_BT > 0) & (z_BT <= floor), z_BT, 0.0)
    return all_reduce_group(
        rest_BT.amax() if rest_BT.numel() else rest_BT.new_zeros(()), dist.ReduceOp.MAX, group
    )


def effective_cap(cap: Tensor, tr: TrustRegionM2, max_rest: Tensor) -> Tensor:
    """The cap as logged: a batch within budget reports its largest trust-region |log r| (a cap that
    clips nothing) instead of inf; 0 without trust-region tokens."""
    largest = tr.top_N.max() if tr.top_N.numel() else max_rest
    return torch.minimum(cap, largest)
