"""LoRA pushes into the real vLLM engine: the engine samples the adapter it was sent, at that adapter's
version, and the push check stops the run in one line when the engine samples anything else."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2po_cli.errors import RunError
from m2po_cli.learner.policy import Learner
from m2po_cli.lora import ADAPTER_FILE
from m2po_cli.models import resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.payload import Adapter
from m2po_cli.train.push import Pusher
from tests.conftest import recipe_for
from tests.learner.test_lora import randomize_adapter

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-qwen3-untied"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A LoRA learner with a random (far from zero) adapter, its engine and pusher, after one push."""
    tmp = tmp_path_factory.mktemp("lora-engine")
    recipe = recipe_for(tmp, "lora.rank=8", "lora.alpha=16")
    model_dir = resolve_model(MODEL)
    learner = Learner(model_dir, recipe)
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len, lora_rank=8)
    pusher = Pusher(learner, engine, tmp, MODEL, len(engine.tokenizer))
    randomize_adapter(learner, seed=3)
    learner.version = 1
    pusher.push()
    yield learner, engine, pusher
    engine.close()


def test_the_engine_samples_the_pushed_adapter_at_its_version(pushed):
    learner, engine, pusher = pushed
    assert pusher.mismatch < 1e-4  # the learner's float32 logprobs of the engine's tokens
    assert engine.lora_request.lora_name == "m2po-v1" and engine.version == 1
    (completion,) = engine.generate([pusher.probe], [7], max_tokens=[4])[0]
    assert completion.token_ids  # sampled with the adapter, stamped with its version (`_completion`)
    assert [p.name for p in pusher.folder.iterdir()] == ["m2po-v1"]


def test_an_adapter_whose_modules_match_nothing_fails_the_check_in_one_line(pushed, tmp_path):
    """vLLM serves the base model for an adapter whose module names it does not know (a debug log
    line only): the push check is what sees it."""
    learner, engine, pusher = pushed
    good = pusher.folder / "m2po-v1"
    bad = tmp_path / "m2po-v2"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    tensors = load_file(str(good / ADAPTER_FILE))
    save_file({k.replace(".self_attn.", ".attn.").replace(".mlp.", ".ffn."): v for k, v in tensors.items()},
              str(bad / ADAPTER_FILE))  # fmt: skip
    payload = Adapter(bad, 2)
    engine.push(payload)
    with pytest.raises(RunError) as caught:
        pusher.check(payload)
    message = str(caught.value)
    assert "\n" not in message and "weight push 2" in message and "adapter m2po-v2" in message
    engine.push(Adapter(good, 1))  # back to the adapter the learner holds
    pusher.check(Adapter(good, 1))


def test_an_engine_left_on_an_older_adapter_fails_the_check(pushed):
    """The learner moves on (a new adapter) and the engine keeps the old one: a stale name."""
    learner, engine, pusher = pushed
    randomize_adapter(learner, seed=4)
    with pytest.raises(RunError, match="differ from the learner.s by"):
        pusher.check(Adapter(pusher.folder / "m2po-v1", 1))
    learner.version = 2
    pusher.push()  # the new adapter, under its own name: the check passes again
    assert pusher.mismatch < 1e-4 and engine.lora_request.lora_name == "m2po-v2"
    assert [p.name for p in pusher.folder.iterdir()] == ["m2po-v2"]


def test_a_full_weight_push_is_checked_the_same_way(tmp_path):
    """Without LoRA the push streams every weight; the same probe check passes on it."""
    recipe = recipe_for(tmp_path)
    model_dir = resolve_model(MODEL)
    learner = Learner(model_dir, recipe)
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len)
    try:
        pusher = Pusher(learner, engine, tmp_path, MODEL, len(engine.tokenizer))
        with torch.no_grad():
            for p in learner.model.parameters():
                p.to_local().mul_(1.5)
        pusher.push()
        assert pusher.mismatch < 1e-4
        assert not (tmp_path / "adapters" / "rank-00000").exists() or not any(pusher.folder.iterdir())
    finally:
        engine.close()
