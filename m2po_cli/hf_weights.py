"""The learner's weights under HF names: read in from the checkpoint, streamed to the rollout engines,
exported as safetensors.

torchtitan's FQNs map to HF names through the model's state-dict adapter (`titan.py`); the map is
built once from shapes alone. Every walk over the weights is a collective when the model is sharded
(each parameter's `full_tensor()` is an all-gather), so every rank walks them in step, and only one
full parameter exists at a time, on the learner's device. Loading is the same walk backwards: rank 0
alone reads the checkpoint and broadcasts it one tensor at a time (`load_hf`).
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from m2po_cli.lora import AdapterNames, is_adapter_key, merged


def load_hf(
    model: torch.nn.Module,
    adapter,
    model_dir: Path,
    rank: int,
    more: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Fill the (sharded, materialized) `model` with the HF checkpoint in `model_dir`. A collective.

    Rank 0 alone reads the safetensors files and converts them to torchtitan names; every tensor is
    then broadcast from it one at a time, in the checkpoint's dtype, on the group's device (NCCL on a
    GPU), and each rank keeps its shard of it (`broadcast_from_rank0`). The other ranks never open
    the files: one read of the checkpoint and one host-to-device copy per job, not per rank, and no
    rank but 0 holds a host copy of it (docs/cluster.md). The shards are the ones every rank reading
    the checkpoint itself would get: FSDP2 sliced those from rank 0's copy too. `more`: what rank 0
    adds for parameters the checkpoint does not hold (a LoRA adapter's initial values), so that every
    parameter is loaded, and every rank holds its slice of the same tensor.
    """
    state = {}
    if rank == 0:
        state = adapter.from_hf(read_checkpoint(model_dir)) | (more() if more is not None else {})
    options = StateDictOptions(full_state_dict=True, strict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint's safetensors files, under HF names, in this process."""
    hf_state = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        hf_state.update(load_file(str(shard)))
    return hf_state


class HFWeights:
    """HF-named views of one (possibly FSDP-sharded) torchtitan model. With LoRA adapters
    (`lora_scale`: alpha / r), the weights are the base with each adapter merged in."""

    def __init__(self, model: torch.nn.Module, adapter, rank: int, lora_scale: float = 0.0):
        self.model, self.adapter, self.rank, self.lora_scale = model, adapter, rank, lora_scale

    def stream(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names, cast to `dtype`, one parameter at a time.

        A collective: every rank must exhaust the iterator, in step with the others. Nothing is
        copied to the host. A tied output layer is not sent (it is the embedding). A projection with
        an adapter is sent merged, `W + scale * B A` (in float32, then cast): never the bare base.
        """
        state = self.model.state_dict()
        plain = {plain_fqn(name): name for name in state}
        for name, value in state.items():
            fqn = plain_fqn(name)
            hf_name = self.names.get(fqn)
            if hf_name is None:
                continue
            full = _full(value)
            lora_a = plain.get(fqn.removesuffix(".weight") + ".lora_a.weight")
            if lora_a is not None:
                b = _full(state[lora_a.replace(".lora_a.", ".lora_b.")])
                full = merged(full, _full(state[lora_a]), b, self.lora_scale)
            ((converted_name, converted),) = self.adapter.to_hf({fqn: full}).items()
            assert converted_name == hf_name, (converted_name, hf_name)
            yield hf_name, converted.detach().to(dtype)

    def adapter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter under PEFT keys, cast to `dtype`, one tensor at a time (`lora.py`).
        A collective, like `stream`; a few MB to a few hundred MB, against the model's GBs."""
        for name, value in self.model.state_dict().items():
            fqn = plain_fqn(name)
            if is_adapter_key(fqn):
                yield self.adapter_names.to_peft(fqn, _full(value).detach().to(dtype))

    @functools.cached_property
    def adapter_names(self) -> AdapterNames:
        shapes = {plain_fqn(k): tuple(v.shape) for k, v in self.model.state_dict().items()}
        return AdapterNames(self.adapter, shapes, self.names)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, full shape) of each tensor `stream` yields, in its order; gathers nothing."""
        shapes = []
        for name, value in self.model.state_dict().items():
            hf_name = self.names.get(plain_fqn(name))
            if hf_name is not None:
                meta = torch.empty(value.shape, dtype=value.dtype, device="meta")  # DTensor: the global shape
                ((_, converted),) = self.adapter.to_hf({plain_fqn(name): meta}).items()
                shapes.append((hf_name, tuple(converted.shape)))
        return shapes

    @functools.cached_property
    def names(self) -> dict[str, str]:
        """torchtitan FQN -> HF name of every parameter the HF checkpoint holds (from shapes only)."""
        names = {}
        for name, value in self.model.state_dict().items():
            if is_adapter_key(name):
                continue
            meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
            converted = self.adapter.to_hf({plain_fqn(name): meta})
            if converted:
                ((names[plain_fqn(name)], _),) = converted.items()
        return names

    def export(self, out_dir: Path, model_dir: Path, dtype_choice: str, shard_bytes: int) -> None:
        """Write a safetensors checkpoint with the source's config and tokenizer (rank 0 writes).

        Streams: at most one shard of `shard_bytes` is held on the host; several shards get an
        HF `model.safetensors.index.json`.
        """
        dtype = getattr(torch, export_dtype(dtype_choice))
        sizes = self.sizes(dtype)
        plan = shard_plan(sizes, shard_bytes)
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
        left = collections.Counter(plan.values())  # tensors still to come, per shard file
        shard: dict[str, torch.Tensor] = {}
        for name, tensor in self.stream(dtype):
            if self.rank != 0:
                continue
            shard[name] = tensor.cpu().contiguous()
            left[plan[name]] -= 1
            if not left[plan[name]]:
                save_file(shard, str(out_dir / plan[name]), metadata={"format": "pt"})
                shard = {}
        if self.rank != 0:
            return
        if len(left) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": plan}
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        copy_model_files(model_dir, out_dir)

    def sizes(self, dtype: torch.dtype) -> dict[str, int]:
        """Bytes of each HF tensor at `dtype`."""
        by_fqn = {plain_fqn(k): v for k, v in self.model.state_dict().items()}
        return {hf: by_fqn[fqn].numel() * dtype.itemsize for fqn, hf in self.names.items()}


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (sharded) parameter: an all-gather for a DTensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def export_dtype(choice: str) -> str:
    """The dtype of HF exports: bfloat16 only when asked for; `auto` exports the float32 master
    weights, so an export does not depend on the machine that wrote it."""
    return "bfloat16" if choice == "bfloat16" else "float32"


def write_hf(out_dir: Path, hf_state: dict[str, torch.Tensor], model_dir: Path, dtype_choice: str) -> None:
    """`hf_state` as `model.safetensors` beside the source model's config and tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, export_dtype(dtype_choice))
    save_file({k: v.to(dtype).contiguous() for k, v in hf_state.items()}, str(out_dir / "model.safetensors"))
    copy_model_files(model_dir, out_dir)


def copy_model_files(model_dir: Path, out_dir: Path) -> None:
    """The source model's config and tokenizer files (everything but its weights)."""
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json", ".bin", ".gguf")):
            (out_dir / f.name).write_bytes(f.read_bytes())


def plain_fqn(name: str) -> str:
    """The module path without the wrappers that activation checkpointing and compile add."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def shard_plan(sizes: dict[str, int], shard_bytes: int) -> dict[str, str]:
    """HF shard file of each tensor: consecutive tensors fill shards of up to `shard_bytes`."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if groups[-1] and used + size > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    if len(groups) == 1:
        return dict.fromkeys(groups[0], "model.safetensors")
    n = len(groups)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, g in enumerate(groups) for name in g}
