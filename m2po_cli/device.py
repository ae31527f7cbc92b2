"""What the recipe's device-dependent choices resolve to on this machine."""

from __future__ import annotations

import torch


def resolve_dtype(choice: str) -> str:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (where bf16 matmuls are slow)."""
    if choice != "auto":
        return choice
    return "bfloat16" if torch.cuda.is_available() else "float32"


def torch_dtype(choice: str) -> torch.dtype:
    """The torch dtype of a recipe's `model.dtype` (after `resolve_dtype`)."""
    return getattr(torch, resolve_dtype(choice))
