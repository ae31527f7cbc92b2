"""Per-token logprobs and entropies without the `[B, L, V]` logits tensor.

The model's output projection is asked for the sampled token's logprob only at the positions that
are scored (response tokens), a chunk of positions at a time: each chunk's logits `[C, V]` live only
while that chunk is computed, so peak memory is a few `C x V` floats (C = `CHUNK_LOGITS // V`),
whatever the sequence length. With grad, each chunk runs under activation checkpointing: its logits
are recomputed in the backward instead of being kept. The arithmetic per position is the same as a
`log_softmax` over the full logits: `log softmax(logits / T)[token]`, in float32, and the entropy
`-sum p log p` of the same distribution.

Chunk size: each chunk's backward writes a whole `[V, D]` gradient of the head's weight, added
to the accumulated one, and a zero-filled `[N, D]` one for its slice of `h`: a fixed cost per chunk,
which small chunks pay many times (2**24 logits is 110 positions at Qwen3's V = 151,936: ~150
chunks for a 16k-token micro-batch). Its memory: a chunk peaks in the backward of its recomputed
forward, with three float32 `[C, V]` buffers at once (the log-softmax kept for its backward, the
gradient coming in and the one going out; `bench/bench_engine_tokens.py` measures it). At
Qwen3-8B's sizes (V = 151,936, D = 4,096), `CHUNK_LOGITS = 2**26` is C = 441 positions: 268 MB a
float32 buffer, 0.80 GB at the peak (2**24: 0.20 GB). Beside it, whatever the chunk, the weight's
gradient G (1.24 GB in bf16, 2.49 GB in float32) and, as a later chunk's is added, a second one: the
head's peak is max(3 x 4 B x C x V + G, 2 G + 2 B x C x V) = 2.6 GB in bf16 (2.5 GB at 2**24).
`bench/memory_budget.py` counts it; the 8B recipe's peak stays in a block's backward.

`LogprobHead` runs inside the model's forward (it replaces the class of the model's `lm_head`, so
parameter names, FSDP2 sharding and checkpoints are unchanged): FSDP2 gathers the head's weight for
the forward and again for the backward exactly as for the plain projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

CHUNK_LOGITS = 2**26  # logits per chunk: 256 MiB in float32


@dataclass
class ScoreRequest:
    """What the head computes in the next forward: positions of `h` (flat over `[B, L]`) and the
    token each one predicts."""

    source_N: Tensor  # int64 index into h.reshape(-1, D)
    targets_N: Tensor  # int64 token ids
    temperature: float
    with_entropy: bool


def chunk_size(vocab: int) -> int:
    return max(1, CHUNK_LOGITS // vocab)


def chunked_logprobs(
    h_ND: Tensor, weight_VD: Tensor, bias_V: Tensor | None, request: ScoreRequest
) -> tuple[Tensor, Tensor | None]:
    """The logprob of `targets_N` under softmax((h W^T + b) / T), and optionally its entropy; `[N]`.

    With grad enabled the logprobs carry grad to `h_ND` and the weight; entropies never do.
    """
    size = chunk_size(weight_VD.shape[0])
    logprobs, entropies = [], []
    for start in range(0, h_ND.shape[0], size):
        h_CD, targets_C = h_ND[start : start + size], request.targets_N[start : start + size]
        if torch.is_grad_enabled():
            logprobs.append(
                checkpoint(
                    _picked, h_CD, weight_VD, bias_V, targets_C, request.temperature, use_reentrant=False
                )
            )
            if request.with_entropy:
                with torch.no_grad():
                    entropies.append(_picked_and_entropy(h_CD, weight_VD, bias_V, targets_C, request)[1])
        else:
            lp, ent = _picked_and_entropy(h_CD, weight_VD, bias_V, targets_C, request)
            logprobs.append(lp)
            entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies) if request.with_entropy else None


def _picked(h_CD: Tensor, weight_VD: Tensor, bias_V, targets_C: Tensor, temperature: float) -> Tensor:
    logp_CV = torch.log_softmax(F.linear(h_CD, weight_VD, bias_V).float() / temperature, dim=-1)
    return logp_CV.gather(-1, targets_C[:, None]).squeeze(-1)


def _picked_and_entropy(h_CD, weight_VD, bias_V, targets_C, request: ScoreRequest):
    logp_CV = torch.log_softmax(F.linear(h_CD, weight_VD, bias_V).float() / request.temperature, dim=-1)
    picked_C = logp_CV.gather(-1, targets_C[:, None]).squeeze(-1)
    entropy_C = -(logp_CV.exp() * logp_CV).sum(-1) if request.with_entropy else None
    return picked_C, entropy_C


class LogprobHead(nn.Linear):
    """An output projection that, while `request` is set, returns `[N]` logprobs (and `[N]`
    entropies) of the requested positions instead of `[B, L, V]` logits."""

    request: ScoreRequest | None = None

    def forward(self, h_BLD: Tensor):
        if self.request is None:
            return super().forward(h_BLD)
        if not self.request.source_N.numel():
            # Nothing to score: an empty result that still depends on every parameter, so that the
            # backward gives each a (zero) gradient and FSDP2 reduce-scatters on every rank alike.
            empty = (h_BLD.sum() + self.weight.sum()).float()[None][:0]
            return empty, empty.detach() if self.request.with_entropy else None
        # index_select, not h[source_N]: a shared prompt's last position feeds every sample of its group,
        # and the backward of advanced indexing adds such repeats with parallel atomic float adds on
        # the CPU, in an order that varies from run to run; index_select's backward adds them in order.
        h_ND = torch.index_select(h_BLD.reshape(-1, h_BLD.shape[-1]), 0, self.request.source_N)
        return chunked_logprobs(h_ND, self.weight, self.bias, self.request)


def install_head(model: nn.Module) -> LogprobHead:
    """Give the model's `lm_head` the `LogprobHead` behaviour in place; return it."""
    head = model.lm_head
    assert isinstance(head, nn.Linear), f"lm_head is a {type(head).__name__}, not a Linear"
    head.__class__ = type("LogprobHead", (LogprobHead, type(head)), {})
    return head


def scored_positions(mask_BL: Tensor) -> Tensor:
    """The positions a request scores, `[B, L]` bool: the mask's, but for column 0 (no token
    precedes it). A request lists them in row-major order (`nonzero`)."""
    scored_BL = mask_BL.bool().clone()
    scored_BL[:, 0] = False
    return scored_BL


def score_request(tokens_BL: Tensor, mask_BL: Tensor, temperature: float, with_entropy: bool) -> ScoreRequest:
    """Score the tokens at `mask_BL` positions (t >= 1): position t - 1 of the output predicts t."""
    row_N, col_N = scored_positions(mask_BL).nonzero(as_tuple=True)
    return ScoreRequest(
        row_N * tokens_BL.shape[1] + col_N - 1, tokens_BL[row_N, col_N], temperature, with_entropy
    )
