"""The torchtitan decoders built from HF configs match HF's logits, and the adapters round-trip weights.

Each case saves a tiny random HF model, builds the torchtitan model from its `config.json` the way the
learner does (meta device, `to_empty`, `init_states`, strict load of `adapter.from_hf`), and compares.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from m2po_cli.titan import UnsupportedModel, load_arch
from tests.tolerances import forward_atol

TINY = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def _qwen3(tied: bool) -> PreTrainedModel:
    return Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tied))


def _qwen2(tied: bool) -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied, use_sliding_window=False))


def _smollm2_like() -> PreTrainedModel:
    tiny = {k: v for k, v in TINY.items() if k != "head_dim"}  # llama: head_dim = hidden / heads
    config = LlamaConfig(**tiny, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config)


CASES = {
    "qwen3-tied": lambda: _qwen3(tied=True),
    "qwen3-untied": lambda: _qwen3(tied=False),
    "qwen2-untied": lambda: _qwen2(tied=False),
    "qwen2-tied": lambda: _qwen2(tied=True),
    "llama-tied": _smollm2_like,
}


def _save(hf_model: PreTrainedModel, out: Path) -> None:
    """Perturb the weights HF initialises to constants (biases 0, norms 1) so their mapping is tested."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf_model.save_pretrained(out)


def _titan(model_dir: Path) -> tuple[torch.nn.Module, object]:
    arch = load_arch(model_dir)
    with torch.device("meta"):
        model = arch.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    hf_state = load_file(str(model_dir / "model.safetensors"))
    model.load_state_dict(arch.adapter.from_hf(dict(hf_state)), strict=True)
    return model.eval(), arch


@pytest.mark.parametrize("case", CASES)
def test_logits_and_round_trip_match_hf(case: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_model = CASES[case]().eval()
    _save(hf_model, tmp_path)
    model, arch = _titan(tmp_path)
    assert arch.family == case.split("-")[0]
    assert arch.tied == case.endswith("-tied")

    tokens_BT = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        expected_BTV = hf_model(tokens_BT).logits
        logits_BTV = model(tokens_BT)
    atol = forward_atol(expected_BTV, hf_model.config.num_hidden_layers)
    torch.testing.assert_close(logits_BTV, expected_BTV, rtol=0, atol=atol)

    hf_state = load_file(str(tmp_path / "model.safetensors"))
    round_trip = arch.adapter.to_hf(model.state_dict())
    assert round_trip.keys() == hf_state.keys()
    for key, value in hf_state.items():
        assert torch.equal(round_trip[key], value), key


def test_qwen2_biases_are_loaded(tmp_path: Path) -> None:
    _save(_qwen2(tied=False), tmp_path)
    model, _ = _titan(tmp_path)
    hf_state = load_file(str(tmp_path / "model.safetensors"))
    bias = model.layers["1"].attention.qkv_linear.wk.bias
    assert torch.equal(bias, hf_state["model.layers.1.self_attn.k_proj.bias"])


def test_qwen2_sliding_window_is_refused(tmp_path: Path) -> None:
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        load_arch(tmp_path)


def test_unsupported_model_type_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UnsupportedModel, match=r"model_type 'gpt2' is not supported \(qwen3, qwen2, llama\)"):
        load_arch(tmp_path)
