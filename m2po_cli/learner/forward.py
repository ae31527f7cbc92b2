"""One forward of the policy over a batch: the response tokens' logprobs (and entropies), each row
whole or, where rows share their prompt, the prompt computed once (`shared_prompts`)."""

from __future__ import annotations

import torch

from m2po_cli.learner import shared_prompts
from m2po_cli.learner.batch import Batch
from m2po_cli.learner.logprobs import LogprobHead, score_request, scored_positions


def forward_logprobs(
    model: torch.nn.Module,
    head: LogprobHead,
    batch: Batch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, L]` logprobs (with grad if enabled) and entropies of the response tokens of `batch`
    through `model`, whose `head` (`install_head`) scores only them; 0 elsewhere.

    Rows with `prompt_lengths_B` run packed, each prompt once (`shared_prompts`)."""
    tokens_BL, mask_BL = batch.tokens_BL.to(device), batch.mask_BL.to(device)
    if batch.prompt_lengths_B is None:
        request = score_request(tokens_BL, mask_BL, temperature, with_entropy)
        inputs: tuple = (tokens_BL,)
    else:
        packed = shared_prompts.pack(batch.tokens_BL, batch.lengths_B, batch.prompt_lengths_B)
        request = packed.score_request(batch.tokens_BL, batch.mask_BL, temperature, with_entropy)
        request.source_N = request.source_N.to(device)
        request.targets_N = request.targets_N.to(device)
        inputs = tuple(t.to(device) for t in (packed.tokens_GT, packed.positions_GT, packed.allowed_G1TT))
    head.request = request
    try:
        logprobs_N, entropy_N = model(*inputs)
    finally:
        head.request = None
    scored_BL = scored_positions(mask_BL)  # the request's positions, in its order
    lp_BL = torch.zeros(mask_BL.shape, device=device).masked_scatter(scored_BL, logprobs_N)
    if entropy_N is None:
        return lp_BL, None
    return lp_BL, torch.zeros_like(lp_BL).masked_scatter(scored_BL, entropy_N)
