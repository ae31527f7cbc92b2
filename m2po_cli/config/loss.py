"""The recipe's `[algorithm]` and `[loss]` tables: the advantage and the policy loss a run trains with.

`[loss]` is one table per loss type, told apart by `type`; a recipe for M2PO differs from one for
GRPO only here. `loss.py` implements each type; docs/losses.md compares them.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field

from m2po_cli.config.tables import Table, field


class AlgorithmConfig(Table):
    advantage: Literal["grpo"] = field("grpo", "Advantage estimator: group-relative (GRPO).")
    normalize_std: bool = field(True, "Divide the group-centred reward by the group's std (+ eps).")
    std_eps: float = field(1e-6, "Added to the group std before dividing.", gt=0)
    behaviour_logprobs: Literal["engine", "learner"] = field(
        "engine",
        "Behaviour logprobs of the importance ratio: the engine's at sampling time, or the learner's "
        "recomputation at the version that generated the batch.",
    )


class GRPOLoss(Table):
    type: Literal["grpo"] = field("grpo", "PPO clipped surrogate (GRPO).")
    eps_low: float = field(0.2, "Lower clip: ratios below 1 - eps_low are clipped.", gt=0, lt=1)
    eps_high: float = field(0.2, "Upper clip: ratios above 1 + eps_high are clipped.", gt=0)
    dual_clip: float | None = field(
        None, "Dual-clip bound c > 1 for negative advantages; unset disables it.", gt=1
    )


class M2POLoss(Table):
    type: Literal["m2po"] = field(
        "m2po", "M2PO, the paper's Algorithm 1: second-moment masking over the global batch."
    )
    tau: float = field(0.04, "Budget on the mean (log r)^2 over trust-region tokens.", gt=0)


class NoTRLoss(Table):
    type: Literal["no_tr"] = field(
        "no_tr", "Importance-weighted r * A with no trust region (the paper's GRPO no TR)."
    )


class M2POCapLoss(Table):
    type: Literal["m2po_cap"] = field(
        "m2po_cap",
        "The released code's rule: clip r to [e^-c, e^c], c the largest cap keeping M2 within tau.",
    )
    tau: float = field(0.04, "Budget on the mean (log r)^2 over trust-region tokens.", gt=0)
    scope: Literal["micro_batch", "global"] = field(
        "micro_batch",
        "Where the cap is computed: each micro-batch (as released) or the whole optimizer batch.",
    )


class GSPOLoss(Table):
    type: Literal["gspo"] = field(
        "gspo", "GSPO: clipped sequence-level ratio (geometric mean of token ratios)."
    )
    eps_low: float = field(3e-4, "Lower clip: sequence ratios below 1 - eps_low are clipped.", gt=0, lt=1)
    eps_high: float = field(4e-4, "Upper clip: sequence ratios above 1 + eps_high are clipped.", gt=0)


LossConfig = Annotated[GRPOLoss | NoTRLoss | M2POLoss | M2POCapLoss | GSPOLoss, Field(discriminator="type")]

# The keys each loss type's table takes, by type.
LOSS_KEYS = {
    table.model_fields["type"].default: set(table.model_fields) for table in get_args(get_args(LossConfig)[0])
}
