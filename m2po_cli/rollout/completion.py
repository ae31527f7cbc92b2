"""What every rollout source hands the packer: one sampled response, from the in-process engine or a
`vllm serve` server alike."""

from __future__ import annotations

from dataclasses import dataclass


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
