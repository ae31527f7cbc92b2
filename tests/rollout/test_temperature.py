"""Behaviour logprobs at a temperature other than 1: the engine's logprobs of its own samples are the
learner's at the same weights, both taken after the temperature. Taken before it (vLLM's raw
logprobs), an on-policy ratio would be exp(log_softmax(z / T) - log_softmax(z)) instead of 1."""

from __future__ import annotations

import pytest
import torch

from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.rollout import engine as engine_module
from m2po_cli.rollout.engine import VLLMEngine
from tests.conftest import recipe_for
from tests.rollout.test_weight_sync import sampled_batch

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-qwen3-untied"
TEMPERATURE = 0.7
SAME = 1e-4  # float32 on both sides: the engine's and the learner's kernels differ in the last bits


@pytest.fixture(scope="module")
def at_temperature(tmp_path_factory):
    recipe = recipe_for(
        tmp_path_factory.mktemp("temperature"),
        f'model.path="{MODEL}"',
        f"rollout.temperature={TEMPERATURE}",
        "rollout.prompts_per_step=4",
    )
    return recipe, Learner(resolve_model(MODEL), recipe)


def gap(engine: VLLMEngine, learner: Learner, recipe) -> tuple[float, int]:
    """Largest |behaviour - learner| logprob over the response tokens of a batch the engine samples,
    and how many tokens that is."""
    batch = sampled_batch(engine, engine.tokenizer, recipe, learner.version)
    rows = batch.to_batch(torch.arange(batch.num_rows))
    learner_BL, _ = learner.score(rows)
    diff_BL = (learner_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL
    return float(diff_BL.max()), int(rows.mask_BL.sum())


def test_behaviour_logprobs_are_the_learners_at_the_sampling_temperature(at_temperature):
    recipe, learner = at_temperature
    engine = VLLMEngine(resolve_model(MODEL), recipe.rollout, "float32", 64)
    try:
        largest, tokens = gap(engine, learner, recipe)
    finally:
        engine.close()
    assert tokens > 40
    assert largest < SAME, f"engine and learner part by {largest:.2e} at temperature {TEMPERATURE}"


def test_logprobs_taken_before_the_temperature_fail_that_check(at_temperature, monkeypatch):
    """The same check on an engine that returns the logprobs before the temperature (vLLM's
    `raw_logprobs`): it parts from the learner far beyond `SAME`, so the check above sees it."""
    recipe, learner = at_temperature
    settings_args = engine_module.engine_args

    def raw(*args, **kwargs):
        return {**settings_args(*args, **kwargs), "logprobs_mode": "raw_logprobs"}

    monkeypatch.setattr(engine_module, "engine_args", raw)
    engine = VLLMEngine(resolve_model(MODEL), recipe.rollout, "float32", 64)
    try:
        largest, _ = gap(engine, learner, recipe)
    finally:
        engine.close()
    assert largest > 100 * SAME, f"raw logprobs part from the learner by only {largest:.2e}"
