"""Episodes on the real engine and real chat templates: every token of an episode is one the engine
sampled or one the template wrote, in order, boundaries included; each turn's end-of-turn token is
trained; an implementation that decoded and re-encoded the sampled turns is caught; and the separate
mode's episodes over HTTP (`play_episodes`) are the colocated mode's (`sample_episodes`), token for
token, for the same seeds."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

import aiohttp
import pytest
import torch

from m2po_cli.builtin_envs import RETRY_MESSAGE
from m2po_cli.data import Problem, Prompt, encode_prompt
from m2po_cli.models import load_tokenizer, resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.episode import EpisodeGroup, build_episodes, play_episodes, sample_episodes
from m2po_cli.rollout.server import EngineServer, server_sampler
from m2po_cli.rollout.settings import request_seed
from m2po_cli.train.pack import pack_groups
from tests.conftest import recipe_for

pytestmark = pytest.mark.slow

MODEL = "builtin:smollm2-135m-instruct"
PROBLEMS = [("What is 17 * 23?", "391"), ("What is 2 + 2?", "4"), ("Compute 99 - 47.", "52")]
TEMPLATE = "{problem} Reply with the number only."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("episodes")
    recipe = recipe_for(
        tmp,
        f'model.path="{MODEL}"',
        "rollout.n=3",
        "rollout.max_new_tokens=48",
        "data.max_prompt_tokens=128",
        'env.name="builtin:retry"',
        "env.max_turns=3",
        "env.max_tokens=240",
    )
    model_dir = resolve_model(MODEL)
    tokenizer = load_tokenizer(model_dir)
    episodes = build_episodes(recipe, tokenizer, model_dir)
    prompts = [
        Prompt(Problem(i, q, a), encode_prompt(tokenizer, TEMPLATE, q)) for i, (q, a) in enumerate(PROBLEMS)
    ]
    seeds = [request_seed(recipe.run.seed, 0, i) for i in range(len(prompts))]
    engine = VLLMEngine(model_dir, recipe.rollout, "float32", recipe.max_model_len)
    calls: list[tuple[list[list[int]], list]] = []

    def generate(token_ids, seeds, max_tokens=None):
        groups = engine.generate(token_ids, seeds, max_tokens)
        calls.append((token_ids, groups))
        return groups

    try:
        groups = sample_episodes(generate, episodes, prompts, seeds)
        yield recipe, model_dir, tokenizer, episodes, prompts, seeds, groups, calls, engine
    finally:
        engine.close()


def not_sampled(groups, calls, prompts, suffix: list[int], eot: int) -> list[str]:
    """Where an episode holds a turn the engine did not sample from exactly the episode's tokens
    before it, or a boundary other than the end-of-turn token and the template's suffix."""
    sampled = {}  # what the engine was given -> what it sampled from it
    for given, answers in calls:
        for tokens, group in zip(given, answers, strict=True):
            for c in group:
                assert c.prompt_ids == tokens  # the engine reports being given exactly these
                sampled.setdefault(tuple(tokens), []).append(c.token_ids)
    wrong = []
    for prompt, group in zip(prompts, groups, strict=True):
        for e, episode in enumerate(group.episodes):
            tokens = list(prompt.token_ids)
            for t, turn in enumerate(episode.turns):
                if turn.token_ids not in sampled.get(tuple(tokens), []):
                    wrong.append(f"problem {prompt.problem.index} episode {e} turn {t}")
                tokens += turn.token_ids
                if t + 1 < len(episode.turns):
                    if turn.token_ids[-1:] != [eot]:
                        wrong.append(f"problem {prompt.problem.index} episode {e} turn {t}: no end of turn")
                    tokens += suffix  # the template's boundary ("\n") and the retry message
            assert tokens == prompt.token_ids + episode.token_ids
    return wrong


def retry_suffix(episodes) -> list[int]:
    return episodes.chat.suffix([{"role": "user", "content": RETRY_MESSAGE}])


def test_every_token_is_sampled_or_written_by_the_template_turn_by_turn(setup):
    _, _, tokenizer, episodes, prompts, _, groups, calls, _ = setup
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert not_sampled(groups, calls, prompts, retry_suffix(episodes), eot) == []
    later = sum(len(e.turns) - 1 for g in groups for e in g.episodes)
    assert later >= 3, "too few episodes took a second turn for the check to mean anything"


def test_the_end_of_turn_is_trained_and_the_environment_is_context(setup):
    _, _, tokenizer, episodes, prompts, _, groups, _, _ = setup
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pack = pack_groups(
        0, 0, [p.token_ids for p in prompts], [g.episodes for g in groups], torch.zeros(3, 3), False, 1e-6
    )
    for b, episode in enumerate(e for g in groups for e in g.episodes):
        index = pack.response_index(torch.tensor([b]))
        tokens, trained = (
            pack.tokens_N[pack.offsets_B1[b] + pack.prompt_len_B[b] :][: index.numel()],
            pack.trained_R[index],
        )
        at = 0
        for segment in episode.segments:
            ids = segment.token_ids if hasattr(segment, "token_ids") else segment
            span = slice(at, at + len(ids))
            assert tokens[span].tolist() == ids
            assert trained[span].all() if hasattr(segment, "token_ids") else not trained[span].any()
            if hasattr(segment, "token_ids"):
                assert pack.behaviour_R[index][span].tolist() == pytest.approx(segment.logprobs)
                if segment.finished:
                    assert ids[-1] == eot and bool(trained[span][-1])
            else:
                assert float(pack.behaviour_R[index][span].abs().sum()) == 0.0
            at += len(ids)
        assert int(pack.turns_B[b]) == len(episode.turns)


def test_decoding_and_re_encoding_the_sampled_turns_is_caught(setup):
    # The mutation: an episode that keeps each turn's text and re-encodes it. SmolLM2's sampled ids
    # are often not the tokenizer's own encoding of their text, and the text drops <|im_end|>: the
    # check of the first test finds turns the engine never sampled.
    _, _, tokenizer, episodes, prompts, seeds, _, _, engine = setup
    original = EpisodeGroup.take
    calls = []

    def generate(token_ids, seeds, max_tokens=None):
        calls.append((token_ids, engine.generate(token_ids, seeds, max_tokens)))
        return calls[-1][1]

    def re_encoding(self, i, completion):
        ids = tokenizer.encode(completion.text, add_special_tokens=False)
        original(self, i, replace(completion, token_ids=ids, logprobs=[0.0] * len(ids)))

    EpisodeGroup.take = re_encoding
    try:
        groups = sample_episodes(generate, episodes, prompts, seeds)
    finally:
        EpisodeGroup.take = original
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert not_sampled(groups, calls, prompts, retry_suffix(episodes), eot) != []


def test_separate_mode_episodes_are_the_colocated_ones(setup, tmp_path):
    recipe, model_dir, tokenizer, episodes, prompts, seeds, groups, _, _ = setup
    server = EngineServer.start(
        model_dir, recipe.rollout, "float32", recipe.max_model_len, tmp_path / "engine.log"
    )
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)

    async def play_all():
        async with aiohttp.ClientSession() as http:
            sample = server_sampler(http, server.url, server.model_name, recipe.rollout, decode, echo=True)
            return await asyncio.gather(
                *(play_episodes(sample, episodes, p, s) for p, s in zip(prompts, seeds, strict=True))
            )

    try:
        server.set_version(0)
        served = asyncio.run(play_all())
    finally:
        server.close()
    for group, over_http in zip(groups, served, strict=True):
        assert [e.token_ids for e in over_http] == [e.token_ids for e in group.episodes]
        assert [e.reward for e in over_http] == [e.reward for e in group.episodes]
