"""Episodes: what a rollout is. The prompt, then the model's sampled turns and the environment's
messages alternating, then the reward. Both rollout modes sample episodes through `EpisodeGroup`
and nothing else; a finished group is graded and packed once (`train/pack.py`).

Without an environment an episode is one turn: exactly the prompt's sampled response. With one
(`[env]`), after each model turn that ended on its end-of-turn token the environment answers
(`environment.EnvSession`); its messages join the episode as the chat template's suffix tokens
(`chat.ChatTurns.suffix`), and the model samples its next turn from the whole episode so far, given
as token ids. Sampled ids are never decoded and re-encoded: the episode's tokens are the sampled ones
and the template's, in order, and every turn checks that the tokens the engine reports it was given
are the episode's (`EpisodeGroup.take`).

What is trained: the model's tokens, each turn's end-of-turn token included; the environment's and
the template's tokens ride along as context (`Episode.trained`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2po_cli.chat import ChatTurns, first_difference
from m2po_cli.config import EnvConfig, Recipe
from m2po_cli.data import Problem, Prompt
from m2po_cli.environment import EnvironmentClass, EnvSession, load_environment
from m2po_cli.rollout.settings import request_seed
from m2po_cli.rollout.types import Completion


@dataclass
class Episode:
    """One sample: its model turns (`Completion`s) and the environment's tokens between them, in order.

    `finished`: the last model turn stopped on its end-of-turn token (not at a length limit).
    `reward`: the environment's score, or None when `[reward]` grades `text`."""

    segments: list[Completion | list[int]] = field(default_factory=list)
    reward: float | None = None
    tool_calls: int = 0
    tool_failures: int = 0

    @classmethod
    def of(cls, completion: Completion) -> Episode:
        """A one-turn episode: today's rollout, one prompt and one answer."""
        return cls([completion])

    @property
    def turns(self) -> list[Completion]:
        return [s for s in self.segments if isinstance(s, Completion)]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in self._tokens(s)]

    @property
    def trained(self) -> list[bool]:
        """Per token: sampled by the model (trained) or written by the environment and the template."""
        return [isinstance(s, Completion) for s in self.segments for _ in self._tokens(s)]

    @property
    def logprobs(self) -> list[float]:
        """The behaviour logprob of each token; 0 on the environment's."""
        return [
            x for s in self.segments for x in (s.logprobs if isinstance(s, Completion) else [0.0] * len(s))
        ]

    def versions(self, version: int) -> list[int]:
        """The weight version that sampled each token (`version` where a turn does not say); an
        environment's token carries the version of the token before it."""
        out: list[int] = []
        for s in self.segments:
            if isinstance(s, Completion):
                out += s.versions or [version] * len(s.token_ids)
            else:
                out += [out[-1] if out else version] * len(s)
        return out

    @property
    def text(self) -> str:
        """The model's turns as text, what `[reward]` grades (the last box is the final answer)."""
        return "\n".join(c.text for c in self.turns)

    @property
    def finished(self) -> bool:
        return self.turns[-1].finished

    @property
    def num_tokens(self) -> int:
        return sum(len(self._tokens(s)) for s in self.segments)

    @staticmethod
    def _tokens(s: Completion | list[int]) -> list[int]:
        return s.token_ids if isinstance(s, Completion) else s


@dataclass(frozen=True)
class TurnRequest:
    """A model turn to sample: episode `sample` of its group, given `token_ids` (prompt and episode so
    far), at most `max_tokens` new ones, one sample seeded `seed`."""

    sample: int
    token_ids: list[int]
    max_tokens: int
    seed: int


class Episodes:
    """The run's episodes: its environment (or none), the chat template's turns and the limits."""

    def __init__(
        self, cfg: EnvConfig, max_new_tokens: int, env: EnvironmentClass | None, chat: ChatTurns | None
    ):
        assert (env is None) == (chat is None)
        self.cfg, self.env, self.chat = cfg, env, chat
        self.max_new_tokens = max_new_tokens
        self.max_tokens = cfg.episode_tokens(max_new_tokens)

    @classmethod
    def one_turn(cls, recipe: Recipe) -> Episodes:
        """One prompt, one answer: the rollouts of a recipe without `[env]`."""
        return cls(recipe.env, recipe.rollout.max_new_tokens, None, None)

    @property
    def multi_turn(self) -> bool:
        return self.env is not None

    def opening(self, problem: Problem) -> list[dict]:
        """The messages the environment's reset() returns for `problem`: they join its prompt."""
        if self.env is None:
            return []
        return EnvSession(self.env, self.cfg.tool_timeout_s).reset(row_of(problem))

    @property
    def tools(self) -> list[dict] | None:
        """The tools' schemas the prompt announces (None: no tools)."""
        return self.env.schemas or None if self.env is not None else None

    def group(self, prompt: Prompt, seed: int, completions: list[Completion]) -> EpisodeGroup:
        """The group of `prompt` after its first turn: `completions`, sampled at `seed`."""
        return EpisodeGroup(self, prompt, seed, completions)


def row_of(problem: Problem) -> dict:
    """The dataset row an environment's reset() reads: problem, answer and the record's other fields."""
    return {**problem.columns, "problem": problem.problem, "answer": problem.answer}


class EpisodeGroup:
    """The `n` episodes of one prompt, turn by turn: `requests()` says which turns to sample next,
    `take` adds one; `open` holds the episodes not ended yet."""

    def __init__(self, episodes: Episodes, prompt: Prompt, seed: int, completions: list[Completion]):
        self.runner, self.prompt, self.seed = episodes, prompt, seed
        self.episodes = [Episode() for _ in completions]
        self.open: set[int] = set(range(len(completions)))
        self.sessions: list[EnvSession] = []
        if episodes.env is not None:
            self.sessions = [EnvSession(episodes.env, episodes.cfg.tool_timeout_s) for _ in completions]
            for s in self.sessions:
                s.reset(row_of(prompt.problem))
        for i, c in enumerate(completions):
            self.take(i, c)

    def tokens(self, i: int) -> list[int]:
        """What episode `i`'s next turn is given: the prompt and the episode so far."""
        return self.prompt.token_ids + self.episodes[i].token_ids

    def requests(self) -> list[TurnRequest]:
        """The next model turn of every open episode."""
        return [self.request(i) for i in sorted(self.open)]

    def request(self, i: int) -> TurnRequest:
        """Open episode `i`'s next model turn, seeded by the group's seed, the sample and the turn."""
        episode = self.episodes[i]
        room = self.runner.max_tokens - episode.num_tokens
        seed = request_seed(self.seed, i, len(episode.turns))
        return TurnRequest(i, self.tokens(i), min(self.runner.max_new_tokens, room), seed)

    def take(self, i: int, completion: Completion) -> None:
        """Episode `i`'s next model turn; the environment answers it, or the episode ends."""
        self._check_given(i, completion)
        episode = self.episodes[i]
        episode.segments.append(completion)
        reply = self._reply(i, completion)
        if reply is None:
            self._end(i)
            return
        suffix = self.runner.chat.suffix(reply)
        # The next turn needs its suffix and at least one sampled token within the episode's budget.
        if episode.num_tokens + len(suffix) + 1 > self.runner.max_tokens:
            self._end(i)
            return
        episode.segments.append(suffix)

    def _reply(self, i: int, completion: Completion):
        if not self.sessions or not completion.finished:
            return None
        if len(self.episodes[i].turns) >= self.runner.cfg.max_turns:
            return None
        return self.sessions[i].respond(completion.text)

    def _end(self, i: int) -> None:
        self.open.discard(i)
        if self.sessions:
            session, episode = self.sessions[i], self.episodes[i]
            episode.reward = session.reward()
            episode.tool_calls, episode.tool_failures = session.tool_calls, session.tool_failures

    def _check_given(self, i: int, completion: Completion) -> None:
        """The engine must have been given the episode's tokens so far, exactly; anything else would
        train other tokens than those the policy saw."""
        given = completion.prompt_ids
        if given is None:
            return
        expected = self.tokens(i)
        at = first_difference(given, expected)
        if at is not None:
            raise RuntimeError(
                f"episode {i} of problem {self.prompt.problem.index}, turn {len(self.episodes[i].turns) + 1}: "
                f"the engine was given {len(given)} tokens, the episode holds {len(expected)}; they differ "
                f"from token {at}"
            )


Generate = Callable[[list[list[int]], list[int], list[int] | None], list[list[Completion]]]


def sample_episodes(
    generate: Generate, episodes: Episodes, prompts: list[Prompt], seeds: list[int]
) -> list[EpisodeGroup]:
    """Every prompt's group of episodes from one engine (`RolloutEngine.generate`), turn by turn: the
    first turns of all prompts in one call, then each round the next turn of every open episode in
    one call, so the engine batches them (the colocated mode; all at the engine's one version)."""
    first = generate([p.token_ids for p in prompts], seeds, None) if prompts else []
    groups = [episodes.group(p, seed, c) for p, seed, c in zip(prompts, seeds, first, strict=True)]
    while asked := [(g, r) for g in groups for r in g.requests()]:
        turns = generate(
            [r.token_ids for _, r in asked], [r.seed for _, r in asked], [r.max_tokens for _, r in asked]
        )
        for (group, request), (completion,) in zip(asked, turns, strict=True):
            group.take(request.sample, completion)
    return groups


def build_episodes(recipe: Recipe, tokenizer: Any, model_dir: Path) -> Episodes:
    """The run's episodes from `[env]` (`episodes_of`)."""
    return episodes_of(recipe.env, recipe.rollout.max_new_tokens, tokenizer, model_dir, recipe.model.path)


def episodes_of(cfg: EnvConfig, max_new_tokens: int, tokenizer: Any, model_dir: Path, model: str) -> Episodes:
    """Episodes of `cfg` for the model in `model_dir` (named `model`): the environment class loaded
    and checked, the chat template checked for turn-by-turn rendering (`ChatTurns.check`). Cheap;
    raises a UserError in one line. Training and `m2po eval` both build theirs here."""
    if not cfg.name:
        return Episodes(cfg, max_new_tokens, None, None)
    env = load_environment(cfg.name)
    chat = ChatTurns(tokenizer, end_of_turn_ids(model_dir, tokenizer), model, env.schemas)
    chat.check()
    return Episodes(cfg, max_new_tokens, env, chat)


def end_of_turn_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokens an engine stops a turn on: the tokenizer's EOS and the generation config's."""
    config = model_dir / "generation_config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return sorted(ids - {None})


Sample = Callable[[list[int], int, int | None], Awaitable[list[Completion] | None]]


async def play_episodes(
    sample: Sample, episodes: Episodes, prompt: Prompt, seed: int
) -> list[Episode] | None:
    """The group of `prompt` from one server (the separate mode): `sample(token_ids, seed, max_tokens)`
    returns a request's completions, None if the engine aborted it. The first turns in one request
    (`n` samples), then each episode's later turns one request at a time, concurrently, the
    environment answering in a worker thread (its tools may take seconds). None if any request was
    aborted: the prompt is sampled again, whole."""
    completions = await sample(prompt.token_ids, seed, None)
    if completions is None:
        return None
    if not episodes.multi_turn:
        return episodes.group(prompt, seed, completions).episodes
    group = await asyncio.to_thread(episodes.group, prompt, seed, completions)

    async def play(i: int) -> bool:
        while i in group.open:
            turn = group.request(i)
            answer = await sample(turn.token_ids, turn.seed, turn.max_tokens)
            if answer is None:
                return False
            await asyncio.to_thread(group.take, i, answer[0])
        return True

    played = await asyncio.gather(*(play(i) for i in sorted(group.open)))
    return group.episodes if all(played) else None


def one_turn(groups: list[list[Completion]]) -> list[list[Episode]]:
    """Groups of sampled responses as one-turn episodes."""
    return [[Episode.of(c) for c in group] for group in groups]
