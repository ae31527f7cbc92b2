"""Advantage estimators."""

from __future__ import annotations

import torch


def grpo_advantages(rewards_PG: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    """GRPO: each sample's reward minus its group's mean, over the group's std (+ eps) if asked.

    `rewards_PG` is prompts x group. The std is the unbiased sample std (torch.std), as in the
    verl code the paper's runs used. A group whose rewards are all equal gets zero advantages.
    """
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred_PG
    return centred_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
