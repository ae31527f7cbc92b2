"""torchtitan model definitions built from a Hugging Face `config.json`.

torchtitan ships fixed flavours (Qwen3-0.6B, Llama-3-8B, ...); a user's checkpoint can be any size,
so the decoder config is derived from the HF config instead. Weights move between the two naming
schemes through torchtitan's own state-dict adapters, which are bit-exact both ways.

Qwen2 / Qwen2.5 have no torchtitan model of their own: they are Qwen3 without qk-norm and with
biases on the q/k/v projections, so they run on the Qwen3 classes with those two switches.

Attention is SDPA on every device (FlexAttention has no backward on CPU): causal over right-padded
rows, or under a dense mask for groups packed with one shared prompt (`MaskableAttention`,
`shared_prompts`). The device picks the kernel (`use_fused_attention`): on a
GPU in bf16 only fused kernels (cuDNN, FlashAttention, memory-efficient) may run, so a silent
fallback to the O(L^2)-memory math kernel becomes an error; the CPU keeps PyTorch's choice. QKV projections stay unfused so parameter names map 1:1
onto the HF checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchtitan.tools.utils
from torch.nn.attention import SDPBackend, sdpa_kernel

# torchtitan picks the device type (and so NCCL vs gloo, cuda vs cpu meshes) at import time.
torchtitan.tools.utils.device_type = "cuda" if torch.cuda.is_available() else "cpu"

from torchtitan.distributed import ParallelDims  # noqa: E402, F401  (the device type set above)
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config  # noqa: E402
from torchtitan.models.common.nn_modules import RMSNorm  # noqa: E402
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402
from torchtitan.protocols.state_dict_adapter import StateDictAdapter  # noqa: E402

_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}


@dataclass(frozen=True)
class ModelArch:
    """A torchtitan decoder config with its model class and HF adapter."""

    family: str
    config: Any  # Qwen3Model.Config | Llama3Model.Config
    adapter: StateDictAdapter
    tied: bool
    hf_config: dict[str, Any]

    def build(self) -> nn.Module:
        return self.config.build()


class UnsupportedModel(ValueError):
    pass


class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
    """Qwen3's HF mapping plus the q/k/v projection biases of Qwen2 / Qwen2.5."""

    def __init__(self, model_config: Qwen3Model.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        for p in "qkv":
            # "{}" is the layer number: both directions abstract the first number of a key.
            self.from_hf_map[f"model.layers.{{}}.self_attn.{p}_proj.bias"] = (
                f"layers.{{}}.attention.qkv_linear.w{p}.bias"
            )


def load_arch(model_dir: str | Path) -> ModelArch:
    """Read `config.json` of an HF checkpoint and build the matching torchtitan config."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    family = hf.get("model_type")
    if family == "qwen3":
        config = _qwen3(hf)
        adapter = Qwen3StateDictAdapter(config, None)
    elif family == "qwen2":
        config = _qwen2(hf)
        adapter = Qwen2StateDictAdapter(config, None)
    elif family == "llama":
        config = _llama(hf)
        adapter = Llama3StateDictAdapter(config, None)
    else:
        raise UnsupportedModel(f"{model_dir}: model_type {family!r} is not supported (qwen3, qwen2, llama)")
    return ModelArch(family, config, adapter, bool(hf.get("tie_word_embeddings", False)), hf)


def _common(hf: dict[str, Any]) -> dict[str, Any]:
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    return dict(
        dim=dim,
        vocab_size=vocab,
        norm=RMSNorm.Config(normalized_shape=dim, eps=hf["rms_norm_eps"], param_init=_NORM_INIT),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),
    )


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters.
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return None if kind == "default" else params


def _attention(hf: dict[str, Any], rope: Any, qk_norm: bool, qkv_bias: bool = False) -> Any:
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    attention = make_gqa_config(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=head_dim,
        wqkv_param_init=_INIT,
        wo_param_init=_INIT,
        inner_attention=ScaledDotProductAttention.Config(),
        fuse_qkv=False,
        rope=rope,
        qk_norm=RMSNorm.Config(normalized_shape=head_dim, eps=hf["rms_norm_eps"], param_init=_NORM_INIT)
        if qk_norm
        else None,
    )
    # make_gqa_config has no bias switch; wkv is the one config both wk and wv are built from.
    qkv = attention.qkv_linear
    qkv.wq.bias = qkv.wkv.bias = qkv_bias
    return attention


def _ffn(hf: dict[str, Any]) -> Any:
    return make_ffn_config(
        dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"], w1_param_init=_INIT, w2w3_param_init=_INIT
    )


def _norm(hf: dict[str, Any]) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=hf["hidden_size"], eps=hf["rms_norm_eps"], param_init=_NORM_INIT)


def _qwen3(hf: dict[str, Any]) -> Qwen3Model.Config:
    if hf.get("attention_bias"):
        raise UnsupportedModel("qwen3 with attention_bias is not supported")
    if _rope_scaling(hf) is not None:
        raise UnsupportedModel("qwen3 with rope scaling is not supported")
    return _qwen_decoder(hf, qk_norm=True, qkv_bias=False)


def _qwen2(hf: dict[str, Any]) -> Qwen3Model.Config:
    """Qwen2 / Qwen2.5: full causal attention only, as the learner has no sliding-window mask."""
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise UnsupportedModel(
            "qwen2 with sliding-window attention is not supported (set use_sliding_window: false)"
        )
    if _rope_scaling(hf) is not None:
        raise UnsupportedModel("qwen2 with rope scaling is not supported")
    return _qwen_decoder(hf, qk_norm=False, qkv_bias=True)


def _qwen_decoder(hf: dict[str, Any], qk_norm: bool, qkv_bias: bool) -> Qwen3Model.Config:
    """Qwen3Model config with rotate-half RoPE; Qwen2 and Qwen3 differ only in the two switches."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=_rope_theta(hf))
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=_norm(hf),
            ffn_norm=_norm(hf),
            attention=_attention(hf, rope, qk_norm=qk_norm, qkv_bias=qkv_bias),
            feed_forward=_ffn(hf),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    return Qwen3Model.Config(layers=layers, **_common(hf))


def _llama(hf: dict[str, Any]) -> Llama3Model.Config:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModel("llama with attention/mlp bias is not supported")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim", head_dim) != head_dim:
        raise UnsupportedModel("llama with head_dim != hidden_size / num_attention_heads is not supported")
    scaling = _rope_scaling(hf)
    extra: dict[str, Any] = {}
    if scaling is not None:
        if (scaling.get("rope_type") or scaling.get("type")) != "llama3":
            raise UnsupportedModel(f"llama rope scaling {scaling!r} is not supported")
        extra = dict(
            scaling="llama",
            scaling_factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    rope = ComplexRoPE.Config(
        dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=_rope_theta(hf), **extra
    )
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=_norm(hf),
            ffn_norm=_norm(hf),
            attention=_attention(hf, rope, qk_norm=False),
            feed_forward=_ffn(hf),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    return Llama3Model.Config(layers=layers, **_common(hf))


def attention_backends(device_type: str, bf16: bool) -> list[SDPBackend] | None:
    """SDPA kernels the learner may use: fused ones only on a GPU in bf16; None keeps torchtitan's list."""
    if device_type != "cuda" or not bf16:
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class MaskableAttention(ScaledDotProductAttention):
    """torchtitan's SDPA that also takes a dense boolean mask (`attention_masks`, `[B, 1, L, L]`,
    True where a query may attend a key) in place of the causal one; `shared_prompts` uses it."""

    def forward(
        self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs
    ):
        if not isinstance(attention_masks, torch.Tensor):
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        q_BNLH, k_BNLH, v_BNLH = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out_BNLH = F.scaled_dot_product_attention(
                q_BNLH, k_BNLH, v_BNLH, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        return out_BNLH.transpose(1, 2)


def accept_attention_masks(model: nn.Module) -> None:
    """Give every SDPA module of `model` the `MaskableAttention` behaviour in place."""
    for module in model.modules():
        if type(module) is ScaledDotProductAttention:
            module.__class__ = MaskableAttention


def use_fused_attention(model: nn.Module, device_type: str, bf16: bool) -> None:
    """Restrict every SDPA module of `model` to `attention_backends(device_type, bf16)`."""
    backends = attention_backends(device_type, bf16)
    if backends is None:
        return
    for module in model.modules():
        if isinstance(module, ScaledDotProductAttention):
            module.sdpa_backends = backends
