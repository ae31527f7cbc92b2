"""The rollout types the engines, the producer and the packer share: a sampled response (from the
in-process engine or a `vllm serve` server alike), and a prompt on its way through the producer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    completions: list[Completion]  # its n completions
