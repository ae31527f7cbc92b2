"""`m2po inspect ratios`: what the recorded importance ratios look like, and what each rule does to them.

r = pi_theta / pi_behav per recorded token, log r = current logprob - behaviour logprob (the
behaviour logprobs the run's loss used: the engine's, or the learner's at the generating version).
Every rule is the training loss itself (`loss.build_loss`), applied to each recorded update as one
optimizer batch: `prepare` on the update's tokens, then `__call__`. A token is "acted on" when the
loss gives it no gradient although its advantage is non-zero: clipped (PPO, GSPO, m2po_cap) or
masked (M2PO), exactly the tokens the loss counts in `loss/clip_frac`. With a sampled record the
M2 rules see only the recorded sequences of an update, not its whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from m2po_cli.config.loss import GRPOLoss, GSPOLoss, LossConfig, M2POCapLoss, M2POLoss, NoTRLoss
from m2po_cli.loss import build_loss
from m2po_cli.loss_metrics import ratio_quantiles
from m2po_cli.record import Records
from m2po_cli.run_dir import CLIP_FRAC

WHAT_IF: tuple[LossConfig, ...] = (
    GRPOLoss(eps_low=0.2, eps_high=0.2),
    GRPOLoss(eps_low=0.2, eps_high=0.28),
    GRPOLoss(eps_low=0.28, eps_high=0.28),
    GRPOLoss(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
    M2POLoss(tau=0.01),
    M2POLoss(tau=0.02),
    M2POLoss(tau=0.04),
    M2POLoss(tau=0.08),
    M2POCapLoss(tau=0.04, scope="global"),
    GSPOLoss(),
)
ABS_R_MINUS_1_EDGES = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, math.inf)


def rule_name(cfg: LossConfig) -> str:
    """A short label of a loss configuration, e.g. `grpo clip 0.2/0.28`, `m2po tau 0.04`."""
    if isinstance(cfg, GRPOLoss):
        eps = f"{cfg.eps_low:g}" if cfg.eps_low == cfg.eps_high else f"{cfg.eps_low:g}/{cfg.eps_high:g}"
        return f"grpo clip {eps}" + (f" dual {cfg.dual_clip:g}" if cfg.dual_clip is not None else "")
    if isinstance(cfg, GSPOLoss):
        return f"gspo clip {_short(cfg.eps_low)}/{_short(cfg.eps_high)}"
    if isinstance(cfg, M2POCapLoss):
        return f"m2po_cap tau {cfg.tau:g}" + (" (micro-batch)" if cfg.scope == "micro_batch" else "")
    if isinstance(cfg, M2POLoss):
        return f"m2po tau {cfg.tau:g}"
    assert isinstance(cfg, NoTRLoss)
    return "no_tr"


def _short(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-") if x < 0.01 else f"{x:g}"


def staleness_buckets(staleness_N: Tensor, replayed_N: Tensor | None = None) -> tuple[Tensor, list[str]]:
    """Each token's staleness bucket (0, 1-3, 4-15, 16-63, ...: powers of four, so a run of any
    staleness gets a handful) and the buckets' names, from the values present ("4", "16-60"). With
    `replayed_N` (bool), replayed tokens get buckets of their own by age, after the fresh ones
    ("replayed 1-3")."""
    replayed_N = torch.zeros_like(staleness_N, dtype=torch.bool) if replayed_N is None else replayed_N
    # One value per (replayed, staleness) pair: replayed ones shifted past every fresh one.
    shift = int(staleness_N.max()) + 1 if len(staleness_N) else 1
    values_U, inverse_N = (staleness_N + shift * replayed_N.long()).unique(return_inverse=True)  # sorted
    pairs = [divmod(v, shift) for v in values_U.tolist()]  # (replayed, staleness)
    key = [(r, 0 if s == 0 else 1 + (s.bit_length() - 1) // 2) for r, s in pairs]
    keys = sorted(set(key))
    names = []
    for k in keys:
        inside = [s for (_, s), ks in zip(pairs, key, strict=True) if ks == k]
        name = str(inside[0]) if len(inside) == 1 else f"{inside[0]}-{inside[-1]}"
        names.append(f"replayed {name}" if k[0] else name)
    bucket_U = torch.tensor([keys.index(k) for k in key], dtype=torch.long)
    return bucket_U[inverse_N], names


@dataclass
class Tokens:
    """The recorded tokens, packed (N), with each token's row attributes broadcast."""

    log_ratio_N: Tensor  # log r as the run's loss formed it
    entropy_N: Tensor
    advantages_N: Tensor
    staleness_N: Tensor
    turn_N: Tensor  # the episode's model turn, from 0
    mismatch_N: Tensor  # learner at the generating version - engine (scored rows only)
    drift_N: Tensor  # current - learner at the generating version (scored rows only)
    scored_N: Tensor  # bool
    update_N: Tensor


def tokens_of(records: Records, behaviour: str) -> Tokens:
    s = records.sample
    per_token = lambda x_R: x_R.repeat_interleave(s.lengths_R)  # noqa: E731
    behaviour_N = s.behaviour_logprobs_N if behaviour == "engine" else s.learner_logprobs_N
    return Tokens(
        log_ratio_N=s.logprobs_N - behaviour_N,
        entropy_N=s.entropy_N,
        advantages_N=per_token(s.advantages_R),
        staleness_N=s.staleness_N,
        turn_N=s.turn_N,
        mismatch_N=s.learner_logprobs_N - s.behaviour_logprobs_N,
        drift_N=s.logprobs_N - s.learner_logprobs_N,
        scored_N=per_token(s.scored_R),
        update_N=per_token(s.update_R),
    )


# --- the rules, through the training loss --------------------------------------------------------


def acted_on(cfg: LossConfig, records: Records, behaviour: str) -> tuple[Tensor, list[dict]]:
    """Which recorded tokens the loss `cfg` clips or masks (bool, packed N), and per-update counts.

    Each recorded update is one optimizer batch, padded to [R, T]. Per update: `acted`, `pos`, `neg`
    (tokens acted on, by advantage sign), `num_tokens`, and the loss's own `m2po/...` metrics.
    """
    s = records.sample
    loss = build_loss(cfg)
    acted_N = torch.zeros(len(s.logprobs_N), dtype=torch.bool)
    starts_R = s.lengths_R.cumsum(0) - s.lengths_R
    per_update = []
    for update in s.update_R.unique().tolist():
        rows = (s.update_R == update).nonzero().flatten()
        index_BT, mask_BT = _padded_index(starts_R[rows], s.lengths_R[rows])
        behaviour_N = s.behaviour_logprobs_N if behaviour == "engine" else s.learner_logprobs_N
        acted_BT, metrics = _apply(
            loss,
            s.logprobs_N[index_BT],
            behaviour_N[index_BT],
            s.advantages_R[rows, None].expand_as(mask_BT).contiguous(),
            mask_BT,
            s.row_R[rows],
        )
        acted_N[index_BT[acted_BT]] = True
        step = int(records.step_R[rows[0]])
        per_update.append({"step": step, "update": update, **metrics})
    return acted_N, per_update


def _padded_index(starts_B: Tensor, lengths_B: Tensor) -> tuple[Tensor, Tensor]:
    """[B, T] indices into the packed tokens (0 on padding) and the mask of valid positions."""
    positions_T = torch.arange(int(lengths_B.max()) if len(lengths_B) else 0)
    mask_BT = positions_T[None, :] < lengths_B[:, None]
    return torch.where(mask_BT, starts_B[:, None] + positions_T[None, :], 0), mask_BT


def _apply(loss, logprobs_BT, behaviour_BT, advantages_BT, mask_BT, rows_B) -> tuple[Tensor, dict]:
    """One optimizer batch through `prepare` and `__call__`; acted-on tokens are those with A != 0
    that get no gradient. `rows_B`: the rows' numbers in their rollout batch, which order M2PO's ties
    as training did (positions here are response positions, in the same order as training's)."""
    num_tokens = int(mask_BT.sum())
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - behaviour_BT, 0.0)
    mask_f_BT = mask_BT.float()
    aux_BT, global_metrics = loss.prepare(log_ratio_BT, advantages_BT, mask_f_BT, rows_B=rows_B)
    logprobs_BT = logprobs_BT.clone().requires_grad_(True)
    value, metrics = loss(logprobs_BT, behaviour_BT, advantages_BT, mask_f_BT, aux_BT, num_tokens)
    (grad_BT,) = torch.autograd.grad(value, logprobs_BT)
    acted_BT = mask_BT & (advantages_BT != 0) & (grad_BT == 0)
    num_acted = round(float(metrics[CLIP_FRAC]) * max(num_tokens, 1))
    assert int(acted_BT.sum()) == num_acted, (int(acted_BT.sum()), num_acted)
    positive_BT = acted_BT & (advantages_BT > 0)
    out = {
        "num_tokens": num_tokens,
        "acted": int(acted_BT.sum()),
        "pos": int(positive_BT.sum()),
        "neg": int((acted_BT & ~positive_BT).sum()),
    }
    return acted_BT, out | {k: float(v) for k, v in global_metrics.items()} | _m2_metrics(metrics)


def _m2_metrics(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if k.startswith("m2po/")}


# --- the report ----------------------------------------------------------------------------------


def analyse(
    records: Records, run_loss: LossConfig, behaviour: str, fresh_rows: int | None = None
) -> tuple[dict, dict[str, Tensor]]:
    """Everything `m2po inspect ratios` shows, as plain numbers (the `--json` output), and the
    tokens each rule acts on (rule name -> bool, packed N). `fresh_rows`: the rows of a rollout
    batch (prompts_per_step x n); rows numbered past them were replayed (`[reuse]`), and their
    tokens are bucketed by age apart from the fresh ones."""
    tokens = tokens_of(records, behaviour)
    rules = list(WHAT_IF) + ([run_loss] if run_loss not in WHAT_IF else [])
    replayed_N = None
    if fresh_rows is not None:
        replayed_N = (records.sample.row_R >= fresh_rows).repeat_interleave(records.sample.lengths_R)
    bucket_N, names = staleness_buckets(tokens.staleness_N, replayed_N)
    report = {
        "num_tokens": len(tokens.log_ratio_N),
        "num_sequences": len(records.sample.lengths_R),
        "num_updates": len(records.updates),
        "steps": sorted({u["step"] for u in records.updates}),
        "behaviour": behaviour,
        "quantiles": quantiles(tokens.log_ratio_N),
        "staleness": [_bucket_stats(tokens, bucket_N == i) | {"bucket": n} for i, n in enumerate(names)],
        "rules": [],
        "entropy_by_ratio": entropy_by_ratio(tokens),
        "mean_entropy": float(tokens.entropy_N.double().mean()),
        "as_trained": _as_trained(records, run_loss),
    }
    report["all"] = _bucket_stats(tokens, torch.ones_like(bucket_N, dtype=torch.bool))
    turns = sorted(tokens.turn_N.unique().tolist())
    if len(turns) > 1:  # episodes of several turns: each turn's tokens apart
        report["turns"] = [_bucket_stats(tokens, tokens.turn_N == t) | {"bucket": str(t + 1)} for t in turns]
    acted = {}
    for cfg in rules:
        acted_N, per_update = acted_on(cfg, records, behaviour)
        rule = _rule_report(cfg, cfg == run_loss, acted_N, per_update, tokens, bucket_N, names)
        if len(turns) > 1:
            rule["frac_by_turn"] = {str(t + 1): _share(acted_N, tokens.turn_N == t) for t in turns}
        report["rules"].append(rule)
        acted[rule_name(cfg)] = acted_N
    return report, acted


def quantiles(log_ratio_N: Tensor) -> dict[str, float]:
    """Order statistics of log r (`loss.ratio_quantiles`, the ones training logs): name -> log r."""
    q = ratio_quantiles(log_ratio_N[None, :], torch.ones(1, len(log_ratio_N)))
    return {name.removeprefix("loss/ratio_"): float(v.log()) for name, v in q.items()}


def _bucket_stats(tokens: Tokens, in_N: Tensor) -> dict:
    """Size, spread of log r, its split into mismatch and drift, and ESS of one group of tokens."""
    log_ratio = tokens.log_ratio_N[in_N].double()
    scored = in_N & tokens.scored_N
    rms = lambda x: float(x.double().square().mean().sqrt()) if len(x) else None  # noqa: E731
    r = log_ratio.exp()
    z = log_ratio * tokens.advantages_N[in_N].sign()
    return {
        "num_tokens": int(in_N.sum()),
        "num_updates": len(tokens.update_N[in_N].unique()),
        "rms_log_ratio": rms(log_ratio),
        "rms_mismatch": rms(tokens.mismatch_N[scored]),
        "rms_drift": rms(tokens.drift_N[scored]),
        "num_scored": int(scored.sum()),
        "ess_frac": float(r.sum().square() / (len(r) * r.square().sum())) if len(r) else None,
        "m2_trust_region": float(z[z > 0].square().mean()) if bool((z > 0).any()) else 0.0,
    }


def _share(acted_N: Tensor, where_N: Tensor) -> float | None:
    """The share of the tokens `where_N` that a rule acts on (None: no such token)."""
    n = int(where_N.sum())
    return int((acted_N & where_N).sum()) / n if n else None


def _rule_report(cfg, is_run_loss, acted_N, per_update, tokens, bucket_N, names) -> dict:
    def frac(where_N: Tensor) -> float | None:
        return _share(acted_N, where_N)

    def m2_after() -> float | None:  # pooled over updates: trust-region tokens kept
        kept = [(u["m2po/m2_after"], u["m2po/num_trust_region"] - u["acted"]) for u in per_update]
        total = sum(k for _, k in kept)
        return sum(m * k for m, k in kept) / total if total else None

    all_N = torch.ones_like(acted_N)
    entropy = tokens.entropy_N[acted_N]
    return {
        "rule": rule_name(cfg),
        "config": cfg.model_dump(),
        "run_loss": is_run_loss,
        "frac": frac(all_N),
        "frac_pos": frac(tokens.advantages_N > 0),
        "frac_neg": frac(tokens.advantages_N < 0),
        "frac_by_staleness": {n: frac(bucket_N == i) for i, n in enumerate(names)},
        "entropy_acted": float(entropy.mean()) if len(entropy) else None,
        "m2_after": m2_after() if isinstance(cfg, M2POLoss) else None,
        "per_update": per_update,
    }


def entropy_by_ratio(tokens: Tokens) -> list[dict]:
    """Share of tokens and their mean entropy per |r - 1| bucket."""
    distance_N = (tokens.log_ratio_N.double().exp() - 1).abs()
    out = []
    for lo, hi in zip(ABS_R_MINUS_1_EDGES[:-1], ABS_R_MINUS_1_EDGES[1:], strict=True):
        in_N = (distance_N >= lo) & (distance_N < hi)
        n = int(in_N.sum())
        mean = float(tokens.entropy_N[in_N].mean()) if n else None
        out.append({"lo": lo, "hi": hi, "frac": n / max(len(distance_N), 1), "entropy": mean})
    return out


def _as_trained(records: Records, run_loss: LossConfig) -> dict | None:
    """The run's own loss on the whole batch of each recorded update, as training logged it."""
    logged = [(u[CLIP_FRAC], u["loss/num_tokens"]) for u in records.updates if CLIP_FRAC in u]
    total = sum(n for _, n in logged)
    if not total:
        return None
    return {"rule": rule_name(run_loss), "frac": sum(f * n for f, n in logged) / total}
