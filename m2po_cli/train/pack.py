"""A finished group of episodes, scored and packed into rows: what both rollout sources do with what
their engines finish, written once. A row is one episode: its prompt, then every model and
environment token in order; the model's tokens are trained, the environment's are context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m2po_cli.advantages import grpo_advantages
from m2po_cli.config import AlgorithmConfig
from m2po_cli.data import Problem
from m2po_cli.grader import Grader
from m2po_cli.rollout.episode import Episode
from m2po_cli.train.packed import PackedRollouts, empty_column, offsets


def pack_groups(
    version: int,
    first_row: int,
    prompts: list[list[int]],
    groups: list[list[Episode]],
    rewards_PG: Tensor,
    normalize_std: bool,
    std_eps: float,
) -> PackedRollouts:
    """Pack P prompts x n episodes generated on this rank; their rows start at `first_row`. The
    model's tokens are trained, the environment's are context (`Episode.trained`)."""
    samples = [(p, e) for p, group in zip(prompts, groups, strict=True) for e in group]
    responses = [e.token_ids for _, e in samples]
    tokens = [t for (p, _), r in zip(samples, responses, strict=True) for t in (*p, *r)]
    lengths = torch.tensor([len(p) + len(r) for (p, _), r in zip(samples, responses, strict=True)])
    advantages_PG = grpo_advantages(rewards_PG, normalize_std, std_eps)
    n = rewards_PG.shape[1]
    return PackedRollouts(
        version=version,
        row_B=torch.arange(first_row, first_row + len(samples)),
        tokens_N=torch.tensor(tokens, dtype=torch.int32),
        offsets_B1=offsets(lengths.long()),
        prompt_len_B=torch.tensor([len(p) for p, _ in samples], dtype=torch.long),
        behaviour_R=torch.tensor([x for _, e in samples for x in e.logprobs], dtype=torch.float32),
        learner_R=empty_column("learner_R"),
        advantages_B=advantages_PG.flatten().float(),
        rewards_B=rewards_PG.flatten().float().clone(),
        finished_B=torch.tensor([e.finished for _, e in samples], dtype=torch.bool),
        solved_B=(rewards_PG.max(dim=1).values > 0).repeat_interleave(n),
        version_B=torch.full((len(samples),), version, dtype=torch.long),
        version_R=torch.tensor([v for _, e in samples for v in e.versions(version)], dtype=torch.int32),
        trained_R=torch.tensor([t for _, e in samples for t in e.trained], dtype=torch.bool),
        tool_calls_B=torch.tensor([e.tool_calls for _, e in samples], dtype=torch.int16),
        tool_failures_B=torch.tensor([e.tool_failures for _, e in samples], dtype=torch.int16),
    )


def grade_and_pack(
    grader: Grader,
    problems: list[Problem],
    prompts: list[list[int]],
    groups: list[list[Episode]],
    versions: list[int],
    algorithm: AlgorithmConfig,
) -> list[PackedRollouts]:
    """Finished groups, scored and packed one a group (`pack_groups`, rows numbered from 0, each group
    at the version its request was submitted at): what both rollout sources do with what their
    engines finish. An environment's own reward() scores its episodes; otherwise the grader scores
    every episode's text in one call (`Grader.score_groups`)."""
    if all(e.reward is not None for g in groups for e in g):
        rewards = [[e.reward for e in g] for g in groups]
    else:
        rewards = grader.score_groups(problems, [[e.text for e in g] for g in groups])
    rewards_GN = torch.tensor(rewards, dtype=torch.float32)
    a = algorithm
    return [
        pack_groups(version, 0, [prompt], [group], rewards_GN[g : g + 1], a.normalize_std, a.std_eps)
        for g, (prompt, group, version) in enumerate(zip(prompts, groups, versions, strict=True))
    ]
