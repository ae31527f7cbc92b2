"""Each request's own seed decides its samples: on the in-process engine of colocated mode and on
`vllm serve` of separate mode alike, whatever else shares the engine's batch (the path a GPU run
takes too: vLLM's per-request generator, not a global one)."""

from __future__ import annotations

import functools

import httpx
import pytest
from transformers import AutoTokenizer

from m2po_cli.data import encode_prompt
from m2po_cli.models import resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.server import GENERATE, EngineServer, parse_completions, sampling_body
from m2po_cli.rollout.settings import request_seed
from tests.conftest import recipe_for

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-qwen3"
SUMS = [(1, 2), (3, 4), (2, 2), (4, 0), (7, 5), (9, 9)]


def tokens(groups) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def test_a_seed_decides_a_prompts_samples_whatever_the_batch_and_the_engine(tmp_path):
    """A prompt's samples are the same alone, among other prompts in another order, and on the other
    engine; another seed gives others."""
    recipe = recipe_for(tmp_path, f'model.path="{MODEL}"')
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    prompts = [encode_prompt(tokenizer, "{problem}", f"{a}+{b}") for a, b in SUMS]
    seeds = [request_seed(recipe.run.seed, 0, i) for i in range(len(prompts))]
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len)
    try:
        alone = [engine.generate([p], [seed])[0] for p, seed in zip(prompts[:3], seeds, strict=False)]
        together = engine.generate(prompts, seeds)
        regrouped = engine.generate(prompts[:1:-1] + prompts[:2], seeds[:1:-1] + seeds[:2])
        reseeded = engine.generate(prompts[:1], [seeds[0] + 10_000])
    finally:
        engine.close()
    server = EngineServer.start(
        model_dir, recipe.rollout, "float32", recipe.max_model_len, tmp_path / "engine.log"
    )
    try:
        server.set_version(0)  # versions are numbers here (the learner's)
        bodies = [sampling_body(p, recipe.rollout, seed) for p, seed in zip(prompts[:3], seeds, strict=False)]
        served = [
            parse_completions(httpx.post(f"{server.url}{GENERATE}", json=b, timeout=60).json(), decode)
            for b in bodies
        ]
    finally:
        server.close()

    assert tokens(together[:3]) == tokens(alone) == tokens(served)
    assert tokens(regrouped) == tokens(together[:1:-1] + together[:2])
    assert tokens(reseeded) != tokens(together[:1])
    assert len({tuple(ids) for ids in tokens(together)[0]}) > 1, "a prompt's n samples differ"
