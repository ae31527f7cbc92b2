"""LoRA adapters: the learner's model with adapters, and the adapter in PEFT format.

The learner converts the decoder's config with torchtitan's `LoRAConverter` before the model is
built: each target projection becomes a frozen base weight `W` plus `lora_a` (`A`, `[r, in]`,
Kaiming-uniform) and `lora_b` (`B`, `[out, r]`, zeros), and computes `W x + (alpha / r) B A x`; every
other parameter is frozen. At the start the adapter adds nothing (`B` = 0), so version 0 is the base model.

What leaves the learner is the adapter in PEFT's format, the one vLLM (`LoRARequest`, `vllm serve
--enable-lora`) and `peft` load: `adapter_model.safetensors`, keyed
`base_model.model.<HF module>.lora_A.weight` / `.lora_B.weight`, beside `adapter_config.json`. The HF
module names come from the model's own state-dict adapter (`titan.py`); where that adapter reorders a
projection's output rows (Llama's q and k, for its RoPE layout), `B`'s rows are reordered the same way,
so `B A` in HF order is the reordered `B A`. `merge` folds an adapter into HF weights for an export.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from m2po_cli.run_dir import ADAPTER_CONFIG

if TYPE_CHECKING:
    from m2po_cli.config import LoraConfig

# HF projection -> the torchtitan config it is built from (k and v share one: `wkv`).
TITAN_TARGETS = {
    "q_proj": "wq",
    "k_proj": "wkv",
    "v_proj": "wkv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PARTS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def with_lora(model_config: Any, lora: LoraConfig) -> Any:
    """A copy of the decoder `model_config` whose target projections carry adapters, the rest frozen."""
    from torchtitan.components.lora import LoRAConverter

    targets = sorted({TITAN_TARGETS[m] for m in lora.target_modules})
    converter = LoRAConverter(LoRAConverter.Config(rank=lora.rank, alpha=lora.alpha, target_modules=targets))
    return converter.convert(copy.deepcopy(model_config))  # `convert` rewrites the tree it is given


def add_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on each adapter's input (PEFT's `lora_dropout`) in forwards that build a graph: the
    training forwards. Scoring (no grad) and the engine see the adapter whole."""
    if not p:
        return

    def drop(_module, args):
        return (F.dropout(args[0], p, training=torch.is_grad_enabled()), *args[1:])

    for module in model.modules():
        if hasattr(module, "lora_a"):
            module.lora_a.register_forward_pre_hook(drop)


def is_adapter_key(fqn: str) -> bool:
    return ".lora_a." in fqn or ".lora_b." in fqn


def base_key(fqn: str) -> str:
    """`layers.0.attention.qkv_linear.wq.lora_a.weight` -> `layers.0.attention.qkv_linear.wq.weight`."""
    module, _part, leaf = fqn.rsplit(".", 2)
    return f"{module}.{leaf}"


class AdapterNames:
    """torchtitan adapter FQNs -> PEFT keys, and the row order each `B` takes to HF, from shapes alone."""

    def __init__(self, hf_adapter, shapes: dict[str, tuple[int, ...]], names: dict[str, str]):
        """`shapes`: every parameter of the (LoRA) model by plain FQN, with its full shape; `names`:
        the HF name of each base weight (`HFWeights.names`)."""
        self.hf_adapter = hf_adapter
        self.shapes = shapes
        self.keys: dict[str, str] = {}
        self._orders: dict[str, torch.Tensor | None] = {}
        for fqn in shapes:
            if is_adapter_key(fqn):
                module, part, _leaf = fqn.rsplit(".", 2)
                hf = names[f"{module}.weight"].removesuffix(".weight")
                self.keys[fqn] = f"{PEFT_PREFIX}{hf}.{_PARTS[part]}.weight"

    def to_peft(self, fqn: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
        """One adapter tensor under its PEFT key, `B`'s rows in HF order."""
        if ".lora_b." in fqn:
            order = self.row_order(base_key(fqn))
            if order is not None:
                value = value[order]
        return self.keys[fqn], value

    def row_order(self, weight_fqn: str) -> torch.Tensor | None:
        """The output-row permutation the HF adapter applies to `weight_fqn` (None: none); the same
        for every layer, so found once per kind of projection."""
        kind = ".".join("{}" if part.isdigit() else part for part in weight_fqn.split("."))
        if kind not in self._orders:
            shape = self.shapes[weight_fqn]
            rows = torch.arange(shape[0], dtype=torch.int32)[:, None].expand(shape).contiguous()
            ((_, moved),) = self.hf_adapter.to_hf({weight_fqn: rows}).items()
            order = moved[:, 0].long()
            self._orders[kind] = None if torch.equal(order, torch.arange(shape[0])) else order
        return self._orders[kind]


def adapter_config(lora: LoraConfig, base_model: str) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for the adapter the learner trains."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_adapter(
    folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig, base_model: str
) -> Path:
    """The adapter as a PEFT folder; written beside it and renamed into place, so a reader (vLLM
    loading it, a resume) never sees half of one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in tensors}
    save_file(state, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, base_model), indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def read_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], float]:
    """A PEFT folder's tensors and its scale (alpha / r)."""
    from safetensors.torch import load_file

    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    return load_file(str(Path(folder) / ADAPTER_FILE)), config["lora_alpha"] / config["r"]


def merge(hf_state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> None:
    """Fold a PEFT adapter into HF weights in place: `W += scale * B A` (computed in float32)."""
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        weight = hf_state.get(f"{module}.weight")
        if weight is None:
            raise KeyError(f"the adapter's {module} has no weight in the base model")
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        hf_state[f"{module}.weight"] = merged(weight, a, b, scale).to(weight.dtype)


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`W + scale * B A`, in float32: what a projection computes with its adapter."""
    return weight.float() + scale * (b.float() @ a.float())


def merge_titan(state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> None:
    """Fold a torchtitan-named adapter (a LoRA run's checkpoint) into torchtitan-named base weights in
    place; the HF adapter's `to_hf` then orders the merged weights as HF does."""
    for key, a in adapter.items():
        if ".lora_a." in key:
            weight, b = state[base_key(key)], adapter[key.replace(".lora_a.", ".lora_b.")]
            state[base_key(key)] = merged(weight, a, b, scale).to(weight.dtype)
