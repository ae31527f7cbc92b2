"""Weight sync: after a push, the running vLLM engine scores tokens exactly as the learner does."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from m2po_cli.data import encode_prompt
from m2po_cli.errors import RunError
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.record import Recorder
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.episode import one_turn
from m2po_cli.rollout.settings import request_seed
from m2po_cli.rollout.types import Completion
from m2po_cli.train.pack import pack_groups
from m2po_cli.train.packed import PackedRollouts
from tests.conftest import recipe_for
from tests.probes import prompt_logprobs, require_version
from tests.steps import train_once

pytestmark = pytest.mark.slow


def logprob_gap(engine: VLLMEngine, learner: Learner, sequences: list[list[int]]) -> float:
    """Largest |engine - learner| logprob over every token (after the first) of `sequences`."""
    from_engine = prompt_logprobs(engine, sequences)
    groups = [[Completion(s[1:], lp, "", True)] for s, lp in zip(sequences, from_engine, strict=True)]
    batch = pack_groups(
        learner.version,
        0,
        [s[:1] for s in sequences],
        one_turn(groups),
        torch.zeros(len(sequences), 1),
        False,
        1e-6,
    )
    rows = batch.to_batch(torch.arange(batch.num_rows))
    learner_BL, _ = learner.score(rows)
    return float(((learner_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL).max())


def no_record(recipe, learner: Learner) -> Recorder:
    """A recorder that records nothing (`inspect.every = 0`)."""
    cfg = recipe.inspect.model_copy(update={"every": 0})
    return Recorder(Path(recipe.run.output_dir), cfg, 0, learner.rank, learner.world)


def sampled_batch(engine: VLLMEngine, tokenizer, recipe, version: int) -> PackedRollouts:
    """A real rollout batch with random rewards: enough to move the weights."""
    prompts = [encode_prompt(tokenizer, "{problem}", f"{a}+{b}") for a, b in [(1, 2), (3, 4), (2, 2), (4, 0)]]
    groups = engine.generate(prompts, [request_seed(0, version, i) for i in range(len(prompts))])
    gen = torch.Generator().manual_seed(0)
    rewards_PG = torch.randint(0, 2, (len(prompts), recipe.rollout.n), generator=gen).float()
    return pack_groups(version, 0, prompts, one_turn(groups), rewards_PG, True, 1e-6)


@pytest.mark.parametrize("model", ["builtin:tiny-qwen3", "builtin:tiny-qwen3-untied"])
def test_push_makes_engine_match_learner(model, tmp_path):
    recipe = recipe_for(
        tmp_path,
        f'model.path="{model}"',
        "optim.lr=0.02",
        "rollout.prompts_per_step=4",
        'loss={type="grpo"}',
    )
    model_dir = resolve_model(model)
    learner = Learner(model_dir, recipe)
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", 64)
    tokenizer = engine.tokenizer
    probe = [
        encode_prompt(tokenizer, "{problem}", p) + tokenizer.encode(a, add_special_tokens=False)
        for p, a in [("3+4", "\\boxed{7}"), ("12+30", "\\boxed{42}"), ("0+0", "\\boxed{1}")]
    ]
    try:
        assert logprob_gap(engine, learner, probe) < 1e-4, "engine and learner disagree before training"

        for _ in range(2):
            batch = sampled_batch(engine, tokenizer, recipe, learner.version)
            train_once(batch, learner, recipe)  # no engine: no push
            stale = logprob_gap(engine, learner, probe)
            # The check below is only meaningful if a missed push is visible to it.
            assert stale > 1e-3, f"the update moved the probe's logprobs by only {stale:.2e}"
            with pytest.raises(RuntimeError, match="skipped"):
                require_version(engine, learner.version)

            # A generator cannot be pickled: the push succeeding proves no message carried the
            # weights; the engine pulled them one tensor at a time, in this process.
            weights = learner.hf_weights(engine.dtype)
            engine.push_weights(weights, learner.version)
            assert inspect.getgeneratorstate(weights) == inspect.GEN_CLOSED
            require_version(engine, learner.version)
            assert logprob_gap(engine, learner, probe) < 1e-4
            # generate checks that every completion was sampled by this version.
            assert len(engine.generate(probe[:1], [1])[0]) == recipe.rollout.n
    finally:
        engine.close()


def test_push_after_a_reload_and_incomplete_pushes(tmp_path):
    """The in-place push agrees with vLLM's own reload, also right after one, and refuses a push that
    leaves a layer or a parameter without new weights."""
    from m2po_cli.rollout.worker import safetensors_items

    recipe = recipe_for(tmp_path, 'model.path="builtin:tiny-qwen3"')
    model_dir = resolve_model("builtin:tiny-qwen3")
    start = list(safetensors_items(model_dir))
    gen = torch.Generator().manual_seed(0)
    moved = [(name, t + 0.05 * torch.randn(t.shape, generator=gen)) for name, t in start]
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", 64)
    probe = [list(range(3, 40)), list(range(20, 45))]

    def gap(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))

    try:
        at_start = prompt_logprobs(engine, probe)
        engine.llm.collective_rpc("m2po_reload", kwargs={"weights": iter(moved), "version": 1})
        engine.llm.reset_prefix_cache()
        reloaded = prompt_logprobs(engine, probe)
        assert gap(at_start, reloaded) > 1e-2, "the moved weights must change the probe"
        engine.push_weights(iter(start), 2)
        assert gap(prompt_logprobs(engine, probe), at_start) < 1e-5
        engine.push_weights(iter(moved), 3)
        assert gap(prompt_logprobs(engine, probe), reloaded) < 1e-5
        for dropped, message in [("k_proj", "qkv_proj"), ("post_attention_layernorm", "did not carry")]:
            partial = [(n, t) for n, t in start if not n.startswith("model.layers.1.") or dropped not in n]
            with pytest.raises(RunError, match=message):
                engine.push_weights(iter(partial), 4)
            with pytest.raises(RuntimeError, match="skipped"):  # half-loaded: no version holds
                require_version(engine, 3)
        # A GPU's push (vLLM's layerwise reload, which only logs what it did not write) stops too.
        partial = [(n, t) for n, t in start if n != "model.layers.1.post_attention_layernorm.weight"]
        with pytest.raises(
            RunError,
            match=r"^weight push 5: the engine's model.layers.1.post_attention_layernorm.weight received nothing",
        ):
            engine.llm.collective_rpc("m2po_reload", kwargs={"weights": iter(partial), "version": 5})
        with pytest.raises(RuntimeError, match="skipped"):
            require_version(engine, 5)
        engine.llm.collective_rpc("m2po_reload", kwargs={"weights": iter(start), "version": 6})
        require_version(engine, 6)  # a whole push through the same path goes through
    finally:
        engine.close()
