"""How many tokens `m2po` masks and `m2po_cap` clips on the same synthetic batches (docs/losses.md).

Each batch: 2 groups x 8 responses x 125 tokens = 2,000 valid tokens, GRPO advantages from 0/1
rewards, heavy-tailed log-ratios (normal 0.1 plus 0.05 x Student-t with 2 dof), tau = 0.04. Prints
one markdown row per seed: trust-region tokens, M2 before, tokens masked by `m2po` (the whole batch),
clipped by `m2po_cap` over the whole batch and per micro-batch of 4 sequences (as released).

    .venv/bin/python bench/compare_masks.py [--seeds 5]
"""

from __future__ import annotations

import argparse

import torch

from m2po_cli.config.loss import M2POCapLoss, M2POLoss
from m2po_cli.loss import build_loss

GROUPS, GROUP_SIZE, LENGTH, MICRO_BATCH = 2, 8, 125, 4


def synthetic_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = GROUPS * GROUP_SIZE
    rewards_PG = (torch.rand(GROUPS, GROUP_SIZE, generator=g) < 0.5).float()
    std_P1 = rewards_PG.std(-1, keepdim=True)
    advantages_PG = (rewards_PG - rewards_PG.mean(-1, keepdim=True)) / (std_P1 + 1e-6)
    t_BT = torch.randn(rows, LENGTH, generator=g) / torch.randn(rows, LENGTH, generator=g).abs().clamp(
        min=0.05
    )
    log_ratio_BT = 0.1 * torch.randn(rows, LENGTH, generator=g) + 0.05 * t_BT
    advantages_BT = advantages_PG.reshape(rows, 1).expand(rows, LENGTH)
    return log_ratio_BT, advantages_BT, torch.ones(rows, LENGTH, dtype=torch.bool)


def count(cfg, log_ratio_BT, advantages_BT, mask_BT) -> tuple[int, dict]:
    """Tokens whose gradient the loss removes, over micro-batches of MICRO_BATCH sequences."""
    loss_fn = build_loss(cfg)
    behaviour_BT = torch.zeros_like(log_ratio_BT)
    aux_BT, prepared = (
        loss_fn.prepare(log_ratio_BT, advantages_BT, mask_BT) if loss_fn.needs_global_pass else (None, {})
    )
    num_tokens, clipped = int(mask_BT.sum()), 0.0
    for start in range(0, log_ratio_BT.shape[0], MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        _, metrics = loss_fn(
            log_ratio_BT[rows], behaviour_BT[rows], advantages_BT[rows], mask_BT[rows],
            None if aux_BT is None else aux_BT[rows], num_tokens,
        )  # fmt: skip
        clipped += float(metrics["loss/clip_frac"]) * num_tokens
    return round(clipped), prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(
        "| seed | trust-region tokens | M2 before | m2po masks | m2po_cap clips (global) | m2po_cap clips (micro-batch) |"
    )
    print("|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        batch = synthetic_batch(seed)
        masked, prepared = count(M2POLoss(), *batch)
        capped_global, _ = count(M2POCapLoss(scope="global"), *batch)
        capped_micro, _ = count(M2POCapLoss(scope="micro_batch"), *batch)
        print(
            f"| {seed} | {int(prepared['m2po/num_trust_region'])} | {float(prepared['m2po/m2_before']):.3f} "
            f"| {masked} | {capped_global} | {capped_micro} |"
        )


if __name__ == "__main__":
    main()
