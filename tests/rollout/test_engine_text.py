"""The colocated engine asks vLLM for token ids and flat logprobs only (`detokenize=False`,
`flat_logprobs`) and decodes the batch's text itself, as separate mode does. Against vLLM's own
output of the same requests (per-token detokenizing, a logprob dict per token): the same tokens,
bit-identical behaviour logprobs, and vLLM's text; on the real in-process engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from m2po_cli.builtin_models import TinyQwen3, random_qwen3, save_model
from m2po_cli.models import resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.settings import request_seed, rollout_sampling
from tests.conftest import recipe_for

pytestmark = pytest.mark.slow

PROBLEMS = ["1+2", "What is 17 * 23?", "Compute 99 - 47.", "日本語で 3+4 は?"]
INCOMPLETE = "\ufffd"  # what a full decode makes of a character whose last bytes were never sampled


def bpe_model(out: Path) -> Path:
    """The tiny Qwen3 shape with random weights and SmolLM2's byte-level BPE tokenizer (49,152
    tokens): its samples are any tokens, characters split across tokens included."""
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("builtin:smollm2-135m-instruct")))
    shape = TinyQwen3(tie_word_embeddings=True, vocab_size=len(tokenizer))
    return save_model(random_qwen3(shape, tokenizer, 0), tokenizer, out)


def engine_for(model_dir: Path, tmp_path: Path):
    recipe = recipe_for(tmp_path, f'model.path="{model_dir}"', "rollout.max_new_tokens=64")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tokenizer.encode(p) for p in PROBLEMS]
    seeds = [request_seed(recipe.run.seed, 0, i) for i in range(len(prompts))]
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len)
    # The separate producer's decode (`RolloutProducer.decode`).
    return engine, recipe, prompts, seeds, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def both_outputs(engine: VLLMEngine, recipe, prompts, seeds, max_tokens=None) -> list[tuple]:
    """(completion, vLLM's output) pairs: `VLLMEngine.generate`'s completions and vLLM's detokenized
    outputs of the same requests, prompt by prompt, sample by sample."""
    from vllm import SamplingParams, TokensPrompt

    ours = engine.generate(prompts, seeds, max_tokens)
    limits = max_tokens or [None] * len(seeds)
    params = [
        SamplingParams(**rollout_sampling(recipe.rollout, s, m)) for s, m in zip(seeds, limits, strict=True)
    ]
    theirs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (c, v)
        for group, out in zip(ours, theirs, strict=True)
        for c, v in zip(group, out.outputs, strict=True)
    ]


def assert_same_tokens_and_logprobs(pairs) -> None:
    for c, v in pairs:
        assert c.token_ids == list(v.token_ids)
        # Bit for bit: they are the behaviour logprobs.
        assert c.logprobs == [entry[tok].logprob for entry, tok in zip(v.logprobs, v.token_ids, strict=True)]


def test_the_tiny_models_text_and_logprobs_are_vllms(tmp_path):
    engine, recipe, prompts, seeds, decode = engine_for(resolve_model("builtin:tiny-qwen3"), tmp_path)
    try:
        pairs = both_outputs(engine, recipe, prompts, seeds)
    finally:
        engine.close()
    assert_same_tokens_and_logprobs(pairs)
    assert [c.text for c, _ in pairs] == [v.text for _, v in pairs]
    assert [c.text for c, _ in pairs] == [decode(c.token_ids) for c, _ in pairs], "separate mode's text"
    assert len({c.text for c, _ in pairs}) > len(PROBLEMS), "samples differ"


def test_byte_level_text_is_vllms_but_for_a_last_incomplete_character(tmp_path):
    """vLLM's incremental decode holds back the bytes of a character not complete yet, and a response
    that ends there never gets them: its text lacks the last token(s), where a full decode of the
    ids (both modes' text) ends in U+FFFD. Everything else is equal. The responses are sampled
    twice: whole, then the first sample of each prompt cut (`max_tokens`) where a character is split."""
    engine, recipe, prompts, seeds, decode = engine_for(bpe_model(tmp_path / "bpe"), tmp_path)
    n = recipe.rollout.n
    try:
        pairs = both_outputs(engine, recipe, prompts, seeds)
        firsts = [pairs[i * n][0].token_ids for i in range(len(prompts))]
        cuts = [
            (i, k)
            for i, ids in enumerate(firsts)
            for k in range(1, len(ids))
            if decode(ids[:k])[-1:] == INCOMPLETE
        ]
        cut = both_outputs(
            engine, recipe, [prompts[i] for i, _ in cuts], [seeds[i] for i, _ in cuts], [k for _, k in cuts]
        )
    finally:
        engine.close()
    assert [c.token_ids for c, _ in cut] == [firsts[i][:k] for i, k in cuts], "a seed's samples, cut"
    for some in (pairs, cut):
        assert_same_tokens_and_logprobs(some)
        assert [c.text for c, _ in some] == [decode(c.token_ids) for c, _ in some], "separate mode's text"
    assert sum(INCOMPLETE in c.text for c, _ in pairs) > len(PROBLEMS), "characters split across tokens"
    assert any(c.text != v.text for c, v in cut), "a response ending inside a character"
    for c, v in pairs + cut:
        if c.text != v.text:
            assert c.text.endswith(INCOMPLETE) and c.text.startswith(v.text), (c.text[-20:], v.text[-20:])
