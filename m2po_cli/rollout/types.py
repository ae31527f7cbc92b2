"""The rollout types the engines, the producer and the packer share: a sampled response (from the
in-process engine or a `vllm serve` server alike), and a prompt on its way through the producer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from m2po_cli.data import Prompt


@dataclass(frozen=True)
class Completion:
    """One sampled response: its tokens, their behaviour logprobs, and the decoded text.

    `versions` is the weight version that sampled each token, where it may vary within a response
    (separate mode: weights change while a request is in flight); None means all tokens share the
    version of their batch."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # stopped on EOS rather than on the length limit
    versions: list[int] | None = None
    # The token ids the engine reports it sampled from (its prompt), where it says; shared by the
    # completions of one request.
    prompt_ids: list[int] | None = None


class Ticket(NamedTuple):
    epoch: int  # the data epoch the prompt was drawn in
    prompt: Prompt


class Request(NamedTuple):
    key: int
    ticket: Ticket
    version: int  # the engine's weight version at submission
    url: str  # the server it goes to


class Finished(NamedTuple):
    ticket: Ticket
    version: int  # the engine's weight version at submission
    episodes: list  # its n episodes (`rollout.episode.Episode`)


@dataclass
class Group:
    """The `n` samples of one prompt, submitted at weight `version`, settled into `rows`."""

    epoch: int  # the data epoch the prompt was drawn in
    prompt: Prompt
    rows: Any  # what `settle` made of the episodes (the episodes themselves without one)
    version: int
    index: int  # admission order: the learner trains groups in it


Settle = Callable[[list[Finished]], list[Any]]  # finished groups -> what the learner takes of each
