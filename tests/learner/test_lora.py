"""LoRA in the learner: only the adapter trains and is checkpointed, and what leaves the learner (the
PEFT adapter, the merged weights) equals the literal formula `W + (alpha / r) B A` in HF names."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from m2po_cli.builtin_models import char_tokenizer, save_model
from m2po_cli.hf_weights import read_checkpoint
from m2po_cli.learner.policy import Learner
from m2po_cli.lora import merge, read_adapter, write_adapter
from m2po_cli.models import resolve_model
from m2po_cli.train.colocated import score_at_behaviour_version
from tests.conftest import recipe_for
from tests.steps import train_once
from tests.workers.dist_learner_worker import OVERRIDES, fixed_batch

RANK, ALPHA = 4, 8.0


def tiny_llama(out):
    """A random Llama (its HF adapter reorders q and k rows for torchtitan's RoPE layout)."""
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    return save_model(LlamaForCausalLM(config), tokenizer, out)


def lora_learner(tmp_path, model_path: str, *more: str) -> Learner:
    recipe = recipe_for(tmp_path, *OVERRIDES, f"lora.rank={RANK}", f"lora.alpha={ALPHA}", *more)
    return Learner(resolve_model(model_path), recipe)


def randomize_adapter(learner: Learner, seed: int) -> None:
    """Every A and B random (B starts at zero, which would hide a wrong B or a wrong row order)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if ".lora_" in name:
                p.to_local().copy_(torch.randn(p.to_local().shape, generator=generator) * 0.2)


def reference_merge(base: dict, peft: dict, scale: float) -> dict:
    """PEFT's formula, literally: every projection with lora_A/lora_B gets W + scale * B @ A."""
    out = {}
    for name, w in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = peft.get(module + ".lora_A.weight"), peft.get(module + ".lora_B.weight")
        out[name] = w if a is None else w + scale * (b @ a)
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_pushed_adapter_and_merged_weights_are_the_peft_formula_in_hf_names(tmp_path, family):
    path = "builtin:tiny-qwen3-untied" if family == "qwen3" else str(tiny_llama(tmp_path / "llama"))
    learner = lora_learner(tmp_path, path)
    randomize_adapter(learner, seed=1)
    peft = dict(learner.adapter_tensors(torch.float32))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layers = learner.arch.hf_config["num_hidden_layers"]
    assert len(peft) == 2 * len(targets) * layers
    base = read_checkpoint(resolve_model(path))
    expected = reference_merge(base, peft, ALPHA / RANK)
    merged = dict(learner.hf_weights(torch.float32))
    assert merged.keys() == {k for k in base if k != "lm_head.weight" or not learner.arch.tied}
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], atol=2e-6, rtol=1e-5, msg=name)
    changed = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert len(changed) == len(targets) * layers  # every target, and nothing else
    # The same adapter written as a PEFT folder and merged from it (what `m2po eval` does).
    folder = write_adapter(tmp_path / "adapter", peft.items(), learner.lora, path)
    tensors, scale = read_adapter(folder)
    assert scale == ALPHA / RANK
    merge(base, tensors, scale)
    for name, value in merged.items():
        torch.testing.assert_close(value, base[name], atol=2e-6, rtol=1e-5, msg=name)


def test_only_the_adapter_trains_keeps_optimizer_state_and_is_checkpointed(tmp_path):
    learner = lora_learner(tmp_path, "builtin:tiny-qwen3-untied", "optim.lr=0.01")
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable)
    assert len([n for n, _ in learner.model.named_parameters() if ".lora_" in n]) == len(trainable)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    start = dict(learner.hf_weights(torch.float32))
    base = read_checkpoint(resolve_model("builtin:tiny-qwen3-untied"))
    assert all(torch.equal(v, base[k]) for k, v in start.items())  # B = 0: the base model
    batch = fixed_batch(0, 4, 8, 90)
    score_at_behaviour_version(batch, learner, True, 8)
    train_once(batch, learner, learner.recipe)
    assert len(learner.optimizer.state) == len(trainable)
    for name, p in learner.model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach().full_tensor(), frozen[name].full_tensor()), name
    moved = dict(learner.hf_weights(torch.float32))
    assert any(not torch.equal(moved[k], start[k]) for k in moved)
    saved = learner.state_dict()["model"]
    assert set(saved) == {n.replace("_checkpoint_wrapped_module.", "") for n in trainable}


def test_the_adapter_starts_from_the_seed_on_every_build(tmp_path):
    """A from the run's seed (B zero): two builds of the same recipe hold the same adapter."""
    first = dict(lora_learner(tmp_path, "builtin:tiny-qwen3-untied").adapter_tensors(torch.float32))
    second = dict(lora_learner(tmp_path, "builtin:tiny-qwen3-untied").adapter_tensors(torch.float32))
    other = dict(
        lora_learner(tmp_path, "builtin:tiny-qwen3-untied", "run.seed=1").adapter_tensors(torch.float32)
    )
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(not v.any() for k, v in first.items() if "lora_B" in k)
    assert any(not torch.equal(first[k], other[k]) for k in first if "lora_A" in k)


def test_the_adapters_gradient_is_the_full_gradient_through_a(tmp_path):
    """At B = 0 the adapted model is the base, and the chain rule gives the adapter's gradient from
    the full model's: dL/dB = (alpha / r) dL/dW A^T and dL/dA = (alpha / r) B^T dL/dW = 0. Both
    learners take the same update of the same batch; the full one's gradients are the reference."""
    from tests.workers.dist_learner_worker import applied_gradients

    def first_gradients(*more: str) -> tuple[dict, dict]:
        recipe = recipe_for(tmp_path, *OVERRIDES, "optim.grad_clip=0", *more)
        learner = Learner(resolve_model(recipe.model.path), recipe)
        grads = applied_gradients(learner)
        start = {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}
        batch = fixed_batch(0, 4, 8, 90)
        score_at_behaviour_version(batch, learner, True, 8)
        train_once(batch, learner, recipe)
        return start, grads[0]

    _, full = first_gradients()
    start, adapter = first_gradients(f"lora.rank={RANK}", f"lora.alpha={ALPHA}")
    assert len(adapter) == 2 * 7 * 2
    for name, grad in adapter.items():
        if ".lora_a." in name:
            assert not grad.any(), name
            continue
        a = start[name.replace(".lora_b.", ".lora_a.")]
        expected = (ALPHA / RANK) * full[name.replace(".lora_b.", ".")] @ a.T
        assert expected.abs().max() > 0, name
        torch.testing.assert_close(
            grad, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()), msg=name
        )
