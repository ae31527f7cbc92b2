"""Policy losses against literal loops and hand-computed values (CPU, single process).

`algorithm1` and `released_rule` below are written token by token, the way the paper's Algorithm 1
and the released code's cap read; the vectorised losses must agree with them exactly on many
random heavy-tailed batches, edge cases included.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2po_cli import second_moment
from m2po_cli.config import Recipe
from m2po_cli.config.loss import GRPOLoss, GSPOLoss, M2POCapLoss, M2POLoss, NoTRLoss
from m2po_cli.loss import MissingBehaviourLogprobs, build_loss
from m2po_cli.loss_metrics import QUANTILES, ratio_quantiles

ALL_LOSSES = [
    GRPOLoss(),
    GRPOLoss(dual_clip=3.0),
    NoTRLoss(),
    M2POLoss(),
    M2POCapLoss(),
    M2POCapLoss(scope="global"),
    GSPOLoss(),
]


# --- literal references ---------------------------------------------------------------------------


def trust_region_m2_values(log_ratio, advantages, valid):
    """{(b, t): (log r)^2} for the tokens with (A > 0 and r > 1) or (A < 0 and r < 1)."""
    m2 = {}
    for b in range(len(log_ratio)):
        for t in range(len(log_ratio[b])):
            x, a = log_ratio[b][t], advantages[b][t]
            if valid[b][t] and ((a > 0 and x > 0) or (a < 0 and x < 0)):
                m2[(b, t)] = x * x
    return m2


def mean(values):
    values = list(values)
    return math.fsum(values) / len(values) if values else 0.0


def algorithm1(log_ratio, advantages, valid, tau, rows=None):
    """The paper's Algorithm 1, one token at a time: while the mean M2 left exceeds tau, the token
    with the largest M2 leaves; of equal ones, the earliest in the batch (row number `rows[b]`, by
    default b, then position t)."""
    rows = list(range(len(log_ratio))) if rows is None else rows
    m2 = trust_region_m2_values(log_ratio, advantages, valid)
    before = mean(m2.values())
    masked = set()
    while m2 and mean(m2.values()) > tau:
        largest = max(m2.values())
        key = min((key for key, value in m2.items() if value == largest), key=lambda k: (rows[k[0]], k[1]))
        masked.add(key)
        del m2[key]
    return masked, before, mean(m2.values())


def released_rule(log_ratio, advantages, valid, tau):
    """The released code's cap, as `kpo_clip_harmful_tokens` / `_solve_tau_from_sorted_delta2` read."""
    m2 = trust_region_m2_values(log_ratio, advantages, valid)
    n = len(m2)
    if n == 0 or mean(m2.values()) <= tau:
        return set(), math.inf
    ascending = sorted(m2.values())
    for k in range(n):
        if math.fsum(min(value, ascending[k]) for value in ascending) / n >= tau:
            break
    cap2 = ascending[k - 1] if k > 0 else 0.0
    return {key for key, value in m2.items() if value >= cap2}, math.sqrt(cap2)


def logged_cap_reference(log_ratio, advantages, valid, tau):
    """`m2po/cap` as the docs define it: the cap when the rule clips; else the largest trust-region
    |log r|, a cap that clips nothing (0 when the trust region is empty). Never negative."""
    clipped, cap = released_rule(log_ratio, advantages, valid, tau)
    if clipped:
        return cap
    m2 = trust_region_m2_values(log_ratio, advantages, valid)
    return math.sqrt(max(m2.values())) if m2 else 0.0


def literal_loss(log_ratio, advantages, valid, value_of):
    """-(1 / N) sum over valid tokens of value_of(b, t, r) * A, N = all valid tokens."""
    total, count = [], 0
    for b in range(len(log_ratio)):
        for t in range(len(log_ratio[b])):
            if valid[b][t]:
                count += 1
                total.append(value_of(b, t, math.exp(log_ratio[b][t])) * advantages[b][t])
    return -math.fsum(total) / max(count, 1)


# --- random heavy-tailed batches ------------------------------------------------------------------


@st.composite
def batches(draw):
    """A small batch: log r heavy-tailed, on a coarse grid (many exact ties) or wide; GRPO-like A."""
    rows, cols = draw(st.integers(1, 8)), draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["grid", "ties", "cauchy", "student", "wide", "tiny"]))
    shape = (rows, cols)
    if kind == "grid":  # multiples of 1/8: ties everywhere, sums exact
        log_ratio = torch.randint(-12, 13, shape, generator=g) / 8
    elif kind == "ties":  # a few values around sqrt(tau): tied groups straddle the stopping point
        values = torch.tensor([0.05, 0.125, 0.25, 0.25, 0.3125, 0.5])
        log_ratio = values[torch.randint(0, 6, shape, generator=g)] * torch.randn(shape, generator=g).sign()
    elif kind == "cauchy":
        log_ratio = 0.05 * torch.randn(shape, generator=g) / torch.randn(shape, generator=g)
    elif kind == "student":
        log_ratio = (
            0.1 * torch.randn(shape, generator=g) / torch.randn(shape, generator=g).abs().clamp(min=0.05)
        )
    elif kind == "wide":
        log_ratio = torch.randn(shape, generator=g)
    else:
        log_ratio = 1e-3 * torch.randn(shape, generator=g)
    signs = draw(st.sampled_from(["mixed", "mixed", "mixed", "zero", "positive"]))
    advantages = torch.randn(rows, 1, generator=g)
    if signs == "mixed":  # some groups all-correct or all-wrong: A = 0
        advantages = advantages * (torch.rand(rows, 1, generator=g) > 0.25)
    elif signs == "zero":
        advantages = torch.zeros(rows, 1)
    else:
        advantages = advantages.abs()
    lengths = torch.randint(-2, cols + 1, (rows, 1), generator=g).clamp(min=0)  # some empty responses
    valid = torch.arange(cols) < lengths
    tau = draw(st.sampled_from([0.04, 0.04, 0.04, 0.02, 0.06, 0.5, 1e-3, 1e-6]))
    # |log r| <= 50: the behaviour logprob of a sampled token is far above -50 - 88, so r never
    # overflows float32 (an infinite r times A = 0 would be NaN in any ratio loss).
    return log_ratio.clamp(-50, 50).float(), advantages.expand(shape).contiguous(), valid, tau


def run_whole(loss_cfg, log_ratio, advantages, valid, behaviour=None):
    """One optimizer batch in one micro-batch: (loss, grad of the logprobs, call metrics, prepare output)."""
    loss_fn = build_loss(loss_cfg)
    behaviour = torch.full_like(log_ratio, -2.0) if behaviour is None else behaviour
    logprobs = (behaviour + log_ratio).requires_grad_()
    aux, prepared = loss_fn.prepare(log_ratio, advantages, valid) if loss_fn.needs_global_pass else (None, {})
    loss, metrics = loss_fn(logprobs, behaviour, advantages, valid, aux, int(valid.sum()))
    loss.backward()
    return loss, logprobs.grad, metrics, aux, prepared


# --- m2po and m2po_cap against the literal loops --------------------------------------------------


@settings(deadline=None, max_examples=300)
@given(batches(), st.sampled_from([1, 2, 1024]))
def test_m2po_matches_algorithm1(batch, num_bins):
    log_ratio, advantages, valid, tau = batch
    # Behaviour logprobs of 0 keep log r exact: logprobs - 0 == log r.
    behaviour = torch.zeros_like(log_ratio)
    with mock.patch.object(second_moment, "NUM_BINS", num_bins):
        loss, _, metrics, keep, prepared = run_whole(
            M2POLoss(tau=tau), log_ratio, advantages, valid, behaviour
        )
    x, a, v = log_ratio.tolist(), advantages.tolist(), valid.tolist()
    masked, before, after = algorithm1(x, a, v, tau)
    assert {tuple(index) for index in torch.nonzero(valid & ~keep).tolist()} == masked
    assert int(prepared["m2po/num_masked"]) == len(masked)
    assert math.isclose(float(prepared["m2po/m2_before"]), before, rel_tol=1e-9, abs_tol=1e-300)
    assert math.isclose(float(prepared["m2po/m2_after"]), after, rel_tol=1e-9, abs_tol=1e-300)
    assert float(prepared["m2po/m2_after"]) <= tau
    expected = literal_loss(x, a, v, lambda b, t, r: 0.0 if (b, t) in masked else r)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(float(metrics["loss/clip_frac"]) * max(valid.sum(), 1), len(masked), abs_tol=1e-3)


@settings(deadline=None, max_examples=300)
@given(batches(), st.sampled_from([1, 2, 1024]))
def test_m2po_cap_matches_released_rule(batch, num_bins):
    log_ratio, advantages, valid, tau = batch
    behaviour = torch.zeros_like(log_ratio)
    for scope in ("micro_batch", "global"):  # one micro-batch: both scopes see the same tokens
        with mock.patch.object(second_moment, "NUM_BINS", num_bins):
            loss, _, metrics, _, prepared = run_whole(
                M2POCapLoss(tau=tau, scope=scope), log_ratio, advantages, valid, behaviour
            )
        x, a, v = log_ratio.tolist(), advantages.tolist(), valid.tolist()
        clipped, cap = released_rule(x, a, v, tau)

        def value(b, t, r, a=a, clipped=clipped, cap=cap):
            return math.exp(math.copysign(cap, a[b][t])) if (b, t) in clipped else r

        assert math.isclose(loss.item(), literal_loss(x, a, v, value), rel_tol=1e-5, abs_tol=1e-6)
        num_valid = max(int(valid.sum()), 1)
        assert round(float(metrics["loss/clip_frac"]) * num_valid) == len(clipped)
        logged_cap = float((prepared if scope == "global" else metrics)["m2po/cap"])
        assert logged_cap == pytest.approx(logged_cap_reference(x, a, v, tau), rel=1e-6, abs=1e-12)


def test_m2po_and_m2po_cap_mask_different_counts():
    """The released cap clips more tokens than Algorithm 1 masks (docs/losses.md has the numbers)."""
    g = torch.Generator().manual_seed(0)
    log_ratio = (
        0.1 * torch.randn(40, 50, generator=g) / torch.randn(40, 50, generator=g).abs().clamp(min=0.05)
    )
    advantages = torch.randn(40, 1, generator=g).expand(40, 50)
    valid = torch.ones(40, 50, dtype=torch.bool)
    _, _, m2po_metrics, _, _ = run_whole(M2POLoss(), log_ratio, advantages, valid)
    _, _, cap_metrics, _, _ = run_whole(M2POCapLoss(), log_ratio, advantages, valid)
    assert 0 < m2po_metrics["loss/clip_frac"] < cap_metrics["loss/clip_frac"]


# --- edge cases ------------------------------------------------------------------------------------


def edge_case(name):
    ones = torch.ones(2, 4)
    valid = torch.ones(2, 4, dtype=torch.bool)
    if name == "no trust-region tokens":  # A > 0 with r <= 1, A < 0 with r >= 1
        return (
            torch.tensor([[-0.5, -1.0, 0.0, -3.0], [0.5, 1.0, 0.0, 2.0]]),
            ones * torch.tensor([[1.0], [-1.0]]),
            valid,
        )
    if name == "everything over budget":
        return (
            torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]]),
            ones * torch.tensor([[1.0], [-1.0]]),
            valid,
        )
    if name == "all-zero advantages":
        return torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(2, 4), valid
    if name == "empty responses":
        return torch.full((2, 4), 2.0), ones, torch.zeros(2, 4, dtype=torch.bool)
    raise ValueError(name)


@pytest.mark.parametrize(
    "name", ["no trust-region tokens", "everything over budget", "all-zero advantages", "empty responses"]
)
@pytest.mark.parametrize(
    "cfg", ALL_LOSSES, ids=lambda c: f"{c.type}-{getattr(c, 'scope', '')}{getattr(c, 'dual_clip', '')}"
)
def test_edge_cases_are_finite(name, cfg):
    log_ratio, advantages, valid = edge_case(name)
    loss, grad, metrics, _, _ = run_whole(cfg, log_ratio, advantages, valid)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(value).all() for value in metrics.values())
    if name in ("all-zero advantages", "empty responses"):
        assert loss.item() == 0 and not grad.any()


def test_m2po_edge_cases_exact():
    log_ratio, advantages, valid = edge_case("no trust-region tokens")
    _, _, metrics, keep, prepared = run_whole(M2POLoss(), log_ratio, advantages, valid)
    assert (
        keep.all() and int(prepared["m2po/num_trust_region"]) == 0 and float(prepared["m2po/m2_before"]) == 0
    )
    log_ratio, advantages, valid = edge_case("everything over budget")
    _, grad, metrics, keep, prepared = run_whole(M2POLoss(), log_ratio, advantages, valid)
    assert not keep.any() and not grad.any() and float(metrics["loss/clip_frac"]) == 1
    assert float(prepared["m2po/m2_before"]) == 1 and float(prepared["m2po/m2_after"]) == 0
    _, _, metrics, _, _ = run_whole(M2POCapLoss(), log_ratio, advantages, valid)
    assert float(metrics["loss/clip_frac"]) == 1 and float(metrics["m2po/cap"]) == 0  # the release: cap 0


def test_of_tied_values_the_earliest_leaves_first():
    """M2 = [1, 1] and 98 tokens of 1e-4, tau = 0.015: after one 1 leaves, the mean is
    (1 + 98e-4) / 99 = 0.0102 <= tau, so only the first 1 (row 0, position 10) is masked."""
    log_ratio = torch.full((1, 100), 0.01)
    log_ratio[0, [10, 70]] = 1.0
    advantages, valid = torch.ones(1, 100), torch.ones(1, 100, dtype=torch.bool)
    _, _, _, keep, prepared = run_whole(M2POLoss(tau=0.015), log_ratio, advantages, valid)
    assert (~keep).nonzero()[:, 1].tolist() == [10] and int(prepared["m2po/num_masked"]) == 1
    assert float(prepared["m2po/threshold"]) == 1.0  # the largest kept z: the other 1
    assert float(prepared["m2po/m2_after"]) == pytest.approx((1 + 98e-4) / 99, rel=1e-6)


def test_of_tied_rows_the_lower_row_number_leaves_first():
    """Two identical rows (one prompt's samples sharing a prefix) in the other order: the row whose
    number in the batch is lower loses its token, wherever it sits in this rank's slice."""
    log_ratio = torch.full((2, 50), 0.01)
    log_ratio[:, 3] = 1.0
    advantages, valid = torch.ones(2, 50), torch.ones(2, 50, dtype=torch.bool)
    loss_fn = build_loss(M2POLoss(tau=0.015))
    keep, prepared = loss_fn.prepare(log_ratio, advantages, valid, rows_B=torch.tensor([41, 40]))
    assert int(prepared["m2po/num_masked"]) == 1
    assert (~keep).nonzero().tolist() == [[1, 3]]  # row 40, the second here
    keep, _ = loss_fn.prepare(log_ratio, advantages, valid)  # no numbers: the order here
    assert (~keep).nonzero().tolist() == [[0, 3]]


# --- gradients -----------------------------------------------------------------------------------


def test_masked_tokens_get_zero_gradient_and_kept_ones_r_a_over_n():
    g = torch.Generator().manual_seed(3)
    log_ratio = 0.2 * torch.randn(6, 20, generator=g)
    log_ratio[0, :3] = torch.tensor([100.0, 5.0, 3.0])  # outliers, r = e^100 overflows float32
    log_ratio[1, :2] = torch.tensor([-100.0, -4.0])
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5], [2.0], [0.0]]).expand(6, 20)
    valid = torch.arange(20) < torch.tensor([[20], [20], [15], [7], [0], [20]])
    loss, grad, _, keep, _ = run_whole(M2POLoss(), log_ratio, advantages, valid)
    masked = valid & ~keep
    assert masked[0, :3].all() and masked[1, :2].all() and torch.isfinite(loss)
    assert (grad[~keep] == 0).all()  # masked and padding: exactly zero
    expected = -(log_ratio.exp() * advantages) / int(valid.sum())
    torch.testing.assert_close(grad[keep], expected[keep], rtol=1e-6, atol=0)


def test_released_cap_clipped_tokens_get_zero_gradient():
    g = torch.Generator().manual_seed(4)
    log_ratio = 0.4 * torch.randn(4, 25, generator=g)
    advantages = torch.tensor([[1.0], [-1.0], [0.3], [-2.0]]).expand(4, 25)
    valid = torch.ones(4, 25, dtype=torch.bool)
    _, grad, metrics, _, _ = run_whole(M2POCapLoss(), log_ratio, advantages, valid, torch.zeros(4, 25))
    z = log_ratio * advantages.sign()
    cap = float(metrics["m2po/cap"])
    clipped = (z > 0) & (z >= cap)
    assert clipped.any() and (grad[clipped] == 0).all()
    expected = -(log_ratio.exp() * advantages) / valid.numel()
    torch.testing.assert_close(grad[~clipped], expected[~clipped], rtol=1e-6, atol=0)


# --- the other losses against hand-computed values -------------------------------------------------


def test_grpo_hand_computed():
    log_ratio = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 4.0, 0.9]]))
    advantages = torch.tensor([[2.0], [-1.0]]).expand(2, 4)
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    loss, grad, metrics, _, _ = run_whole(GRPOLoss(), log_ratio, advantages, valid)
    # Row 0 (A = 2): min(r, 1.2) * 2 -> 2.4, 1.0, 2.2; row 1 (A = -1): max(r, 0.8) * -1 -> -1.5, -0.8, -4, -0.9
    assert loss.item() == pytest.approx(-(2.4 + 1.0 + 2.2 - 1.5 - 0.8 - 4.0 - 0.9) / 7, rel=1e-6)
    assert float(metrics["loss/clip_frac"]) == pytest.approx(2 / 7)  # 1.5 with A > 0, 0.5 with A < 0
    assert float(metrics["loss/clip_frac_pos"]) == pytest.approx(1 / 7)
    assert float(metrics["loss/clip_frac_neg"]) == pytest.approx(1 / 7)
    assert float(metrics["loss/tr_frac"]) == pytest.approx(4 / 7)  # r = 1.5, 1.1 (A > 0); 0.5, 0.9 (A < 0)
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5, 4.0, 0.9]  # the valid ones
    assert float(metrics["loss/abs_log_ratio_mean"]) == pytest.approx(
        sum(abs(math.log(r)) for r in ratios) / 7
    )
    assert grad[0, 0] == 0 and grad[1, 1] == 0
    loss, grad, metrics, _, _ = run_whole(GRPOLoss(dual_clip=3.0), log_ratio, advantages, valid)
    assert loss.item() == pytest.approx(-(2.4 + 1.0 + 2.2 - 1.5 - 0.8 - 3.0 - 0.9) / 7, rel=1e-6)
    assert float(metrics["loss/dual_clip_frac"]) == pytest.approx(1 / 7) and grad[1, 2] == 0


def test_no_tr_is_plain_importance_weighting():
    log_ratio = torch.tensor([[3.0, -2.0], [0.5, 9.0]])
    advantages = torch.tensor([[1.0], [-2.0]]).expand(2, 2)
    valid = torch.tensor([[True, True], [True, False]])
    loss, grad, metrics, _, _ = run_whole(NoTRLoss(), log_ratio, advantages, valid)
    r = log_ratio.exp()
    assert loss.item() == pytest.approx(float(-(r[0, 0] + r[0, 1] - 2 * r[1, 0]) / 3), rel=1e-6)
    assert float(metrics["loss/clip_frac"]) == 0 and grad[1, 1] == 0


def test_gspo_sequence_ratio_and_clip():
    log_ratio = torch.tensor([[1e-4, 3e-4, 9.0], [0.01, -0.01, 0.0], [0.02, 0.0, 0.0]])
    advantages = torch.tensor([[1.0], [-1.0], [1.0]]).expand(3, 3)
    valid = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    loss, grad, metrics, _, _ = run_whole(GSPOLoss(), log_ratio, advantages, valid)
    s0, s1, s2 = math.exp(2e-4), 1.0, math.exp(0.02)  # geometric means over each response
    # s2 = 1.0202 > 1 + 4e-4 with A > 0: clipped; each token carries its sequence's term.
    expected = -(2 * s0 * 1 + 3 * s1 * -1 + 1 * (1 + 4e-4) * 1) / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert float(metrics["loss/clip_frac"]) == pytest.approx(1 / 6) and grad[2, 0] == 0
    assert float(metrics["loss/seq_ratio_mean"]) == pytest.approx((2 * s0 + 3 * s1 + s2) / 6, rel=1e-6)
    # Unclipped: d/dlogprob of -(len * s * A) / N = -s * A / N for every token of the sequence.
    torch.testing.assert_close(grad[0, :2], torch.full((2,), -s0 / 6), rtol=1e-5, atol=0)


def test_ratio_quantiles_are_exact_order_statistics():
    g = torch.Generator().manual_seed(5)
    log_ratio = torch.randn(7, 33, generator=g)
    valid = torch.rand(7, 33, generator=g) > 0.3
    metrics = ratio_quantiles(log_ratio, valid)
    values = log_ratio[valid]
    for name, q in QUANTILES.items():
        expected = torch.quantile(values, q, interpolation="lower").exp()
        assert float(metrics[f"loss/ratio_{name}"]) == pytest.approx(float(expected), rel=1e-6)
    assert float(metrics["loss/ratio_max"]) == pytest.approx(float(values.max().exp()), rel=1e-6)
    assert ratio_quantiles(log_ratio, torch.zeros_like(valid)) == {}


# --- micro-batch invariance ------------------------------------------------------------------------


def heavy_batch(seed=7, rows=12, cols=30):
    g = torch.Generator().manual_seed(seed)
    log_ratio = (
        0.15
        * torch.randn(rows, cols, generator=g)
        / torch.randn(rows, cols, generator=g).abs().clamp(min=0.05)
    )
    log_ratio[:, ::7] = torch.round(log_ratio[:, ::7] * 4) / 4  # ties across rows
    advantages = (torch.randn(rows, 1, generator=g) * (torch.rand(rows, 1, generator=g) > 0.2)).expand(
        rows, cols
    )
    valid = torch.arange(cols) < torch.randint(0, cols + 1, (rows, 1), generator=g)
    behaviour = -3 * torch.rand(rows, cols, generator=g)
    return log_ratio, advantages, valid, behaviour


def run_micro_batches(cfg, log_ratio, advantages, valid, behaviour, sizes):
    """prepare once on the whole batch, then one call + backward per micro-batch of `sizes` rows."""
    loss_fn = build_loss(cfg)
    logprobs = (behaviour + log_ratio).requires_grad_()
    aux, _ = loss_fn.prepare(log_ratio, advantages, valid) if loss_fn.needs_global_pass else (None, {})
    total, metrics, start = 0.0, {}, 0
    for size in sizes:
        rows = slice(start, start + size)
        loss, mb_metrics = loss_fn(
            logprobs[rows], behaviour[rows], advantages[rows], valid[rows],
            None if aux is None else aux[rows], int(valid.sum()),
        )  # fmt: skip
        loss.backward()
        total += loss.item()
        for name, value in mb_metrics.items():
            metrics[name] = metrics.get(name, 0) + float(value)
        start += size
    return total, logprobs.grad, metrics, aux


@pytest.mark.parametrize(
    "cfg", [c for c in ALL_LOSSES if getattr(c, "scope", "global") == "global"], ids=lambda c: c.type
)
def test_result_does_not_depend_on_micro_batch_size(cfg):
    batch = heavy_batch()
    whole_loss, whole_grad, whole_metrics, whole_aux = run_micro_batches(cfg, *batch, [12])
    if cfg.type == "m2po":
        assert 0 < int((batch[2] & ~whole_aux).sum()) < int(batch[2].sum())  # some masked, not all
    for sizes in ([5, 7], [1, 4, 2, 5], [1] * 12):
        loss, grad, metrics, _ = run_micro_batches(cfg, *batch, sizes)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        assert torch.equal(grad, whole_grad)
        assert metrics.keys() == whole_metrics.keys()
        for name, value in metrics.items():
            assert value == pytest.approx(whole_metrics[name], rel=1e-5, abs=1e-7), name


def test_released_micro_batch_scope_does_depend_on_micro_batches():
    """As released, the cap is per micro-batch: a calm micro-batch is not clipped at all."""
    log_ratio = torch.cat([torch.full((2, 10), 0.01), torch.full((2, 10), 0.5)])
    log_ratio[3, 0] = 3.0
    advantages, valid = torch.ones(4, 10), torch.ones(4, 10, dtype=torch.bool)
    behaviour = torch.zeros(4, 10)
    _, _, whole, _ = run_micro_batches(M2POCapLoss(), log_ratio, advantages, valid, behaviour, [4])
    _, _, split, _ = run_micro_batches(M2POCapLoss(), log_ratio, advantages, valid, behaviour, [2, 2])
    assert whole["loss/clip_frac"] != split["loss/clip_frac"]


def test_logged_cap_is_zero_without_trust_region_tokens():
    """Two tokens, neither in the trust region: nothing to cap, so the logged cap is 0 (not -0.2)."""
    log_ratio, advantages = torch.tensor([[-0.5], [0.2]]), torch.tensor([[1.0], [-1.0]])
    valid = torch.ones(2, 1, dtype=torch.bool)
    for scope in ("micro_batch", "global"):
        _, _, metrics, _, prepared = run_whole(M2POCapLoss(scope=scope), log_ratio, advantages, valid)
        assert float((prepared if scope == "global" else metrics)["m2po/cap"]) == 0.0


@settings(deadline=None, max_examples=200)
@given(batches(), st.integers(0, 2**31))
def test_logged_cap_per_micro_batch_is_the_token_weighted_applied_cap(batch, split_seed):
    """Micro-batch scope: `m2po/cap` sums, over micro-batches, each one's share of the valid tokens
    times the cap it applied (its largest trust-region |log r| when it clips nothing); never < 0."""
    log_ratio, advantages, valid, tau = batch
    rows = log_ratio.shape[0]
    g = torch.Generator().manual_seed(split_seed)
    cuts = sorted(set(torch.randint(1, rows + 1, (3,), generator=g).tolist()) | {rows})
    sizes = [b - a for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    behaviour = torch.zeros_like(log_ratio)
    _, _, metrics, _ = run_micro_batches(M2POCapLoss(tau=tau), log_ratio, advantages, valid, behaviour, sizes)
    num_valid, expected, start = max(int(valid.sum()), 1), 0.0, 0
    for size in sizes:
        part = slice(start, start + size)
        x, a, v = log_ratio[part].tolist(), advantages[part].tolist(), valid[part].tolist()
        expected += int(valid[part].sum()) / num_valid * logged_cap_reference(x, a, v, tau)
        start += size
    assert metrics["m2po/cap"] >= 0
    assert metrics["m2po/cap"] == pytest.approx(expected, rel=1e-5, abs=1e-9)


# --- wiring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ALL_LOSSES, ids=lambda c: c.type)
def test_a_float_mask_works_like_a_bool_mask(cfg):
    log_ratio, advantages, valid, behaviour = heavy_batch(seed=8)
    loss, grad, metrics, _ = run_micro_batches(cfg, log_ratio, advantages, valid, behaviour, [12])
    loss_f, grad_f, metrics_f, _ = run_micro_batches(
        cfg, log_ratio, advantages, valid.float(), behaviour, [12]
    )
    assert loss == loss_f and torch.equal(grad, grad_f) and metrics == metrics_f


@pytest.mark.parametrize("cfg", ALL_LOSSES, ids=lambda c: c.type)
def test_missing_behaviour_logprobs_stop_the_run(cfg):
    loss_fn = build_loss(cfg)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    advantages, valid = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    aux = loss_fn.prepare(torch.zeros(2, 3), advantages, valid)[0] if loss_fn.needs_global_pass else None
    with pytest.raises(MissingBehaviourLogprobs, match="behaviour policy's logprob"):
        loss_fn(logprobs, None, advantages, valid, aux, 6)
    with pytest.raises(ValueError, match="same response tokens"):
        loss_fn(logprobs, torch.zeros(2, 4), advantages, valid, aux, 6)


def test_recipe_loss_tables_build_their_losses():
    base = {"model": {"path": "builtin:tiny-qwen3"}, "data": {"source": "synthetic:arithmetic"}}
    expected = {"grpo": False, "no_tr": False, "m2po": True, "m2po_cap": False, "gspo": False}
    for loss_type, global_pass in expected.items():
        recipe = Recipe.model_validate(base | {"loss": {"type": loss_type}})
        assert build_loss(recipe.loss).needs_global_pass is global_pass
    recipe = Recipe.model_validate(base | {"loss": {"type": "m2po_cap", "scope": "global"}})
    assert build_loss(recipe.loss).needs_global_pass
    assert Recipe.model_validate(base | {"loss": {"type": "gspo"}}).loss == GSPOLoss(
        eps_low=3e-4, eps_high=4e-4
    )


# --- ties: one prompt's samples share prefixes, so equal M2 straddle the stopping point -----------


def tied_batch(seed: int, groups: int, size: int, cols: int):
    """`groups` prompts x `size` samples: each sample repeats its group's log-ratios exactly for a
    prefix of its own length, then has its own; all on a grid of 1/8 (exact sums); advantages of
    both signs, some 0; some responses short."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-6, 7, (groups, 1, cols), generator=g) / 8
    own = torch.randint(-6, 7, (groups, size, cols), generator=g) / 8
    prefix = torch.randint(0, cols + 1, (groups, size, 1), generator=g)
    rows = groups * size
    log_ratio = torch.where(torch.arange(cols) < prefix, base, own).reshape(rows, cols).float()
    advantages = (torch.randint(-2, 3, (rows, 1), generator=g) / 2).expand(rows, cols).contiguous()
    valid = torch.arange(cols) < torch.randint(1, cols + 1, (rows, 1), generator=g)
    return log_ratio, advantages, valid


def values_together(log_ratio, advantages, valid, tau):
    """The rule with equal M2 leaving together: what one at a time is checked against."""
    m2 = trust_region_m2_values(log_ratio, advantages, valid)
    masked = set()
    while m2 and mean(m2.values()) > tau:
        largest = max(m2.values())
        for key in [key for key, value in m2.items() if value == largest]:
            masked.add(key)
            del m2[key]
    return masked


TIE_TAUS = (0.01, 0.04, 0.1)


def test_tied_batches_stop_inside_a_tie_often():
    """The batches below force the path they test: in many of them Algorithm 1 stops inside a run
    of equal M2, where leaving together would mask more."""
    inside = 0
    for seed in range(60):
        x, a, v = (t.tolist() for t in tied_batch(seed, 3, 4, 10))
        tau = TIE_TAUS[seed % 3]
        inside += len(algorithm1(x, a, v, tau)[0]) < len(values_together(x, a, v, tau))
    assert inside >= 10, inside


@settings(deadline=None, max_examples=200)
@given(
    st.integers(0, 2**31),
    st.integers(1, 4),
    st.integers(2, 6),
    st.integers(2, 12),
    st.sampled_from(TIE_TAUS),
    st.sampled_from([1, 2, 1024]),
)
def test_m2po_masks_tied_tokens_one_at_a_time_whatever_the_split_and_order(
    seed, groups, size, cols, tau, num_bins
):
    """Against the literal loop: the masked set, the loss and the gradient, for micro-batches of
    every size and for the rows in another order on this rank (their numbers passed along)."""
    log_ratio, advantages, valid = tied_batch(seed, groups, size, cols)
    x, a, v = log_ratio.tolist(), advantages.tolist(), valid.tolist()
    masked, _, after = algorithm1(x, a, v, tau)
    rows = groups * size
    behaviour = torch.zeros_like(log_ratio)
    expected_loss = literal_loss(x, a, v, lambda b, t, r: 0.0 if (b, t) in masked else r)
    n = max(int(valid.sum()), 1)
    expected_grad = torch.tensor(
        [[0.0 if (b, t) in masked or not v[b][t] else -math.exp(x[b][t]) * a[b][t] / n for t in range(cols)]
         for b in range(rows)]
    )  # fmt: skip
    with mock.patch.object(second_moment, "NUM_BINS", num_bins):
        for sizes in ([rows], [1] * rows, [rows // 2, rows - rows // 2]):
            loss, grad, _, keep = run_micro_batches(
                M2POLoss(tau=tau), log_ratio, advantages, valid, behaviour, sizes
            )
            assert {tuple(i) for i in torch.nonzero(valid & ~keep).tolist()} == masked
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        keep, prepared = build_loss(M2POLoss(tau=tau)).prepare(
            log_ratio[order], advantages[order], valid[order], rows_B=order
        )
    assert torch.equal(
        keep, (valid & ~torch.tensor([[(b, t) in masked for t in range(cols)] for b in range(rows)]))[order]
    )
    assert float(prepared["m2po/m2_after"]) == pytest.approx(after, rel=1e-9, abs=1e-300)
