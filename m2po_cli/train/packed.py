"""Packed rollouts: the rows of a rollout batch as flat tensors with offsets.

A row is one sampled response with its prompt. `tokens_N` holds every row's prompt then response,
concatenated; row b spans `tokens_N[offsets_B1[b] : offsets_B1[b + 1]]`, its first `prompt_len_B[b]`
tokens are the prompt. Per-token values exist only for response tokens, row after row (R = the
rows' response tokens): `behaviour_R` (the engine's logprob at sampling time), `version_R` (the
weight version that sampled the token) and `learner_R` (the learner's recomputation at the
generating version, empty unless `algorithm.behaviour_logprobs = "learner"`). A row costs 4 bytes
per token plus 8 (or 12) per response token plus 48 bytes; texts, answers and problem ids are not
kept (the grader has read them on the rank that generated the row).

Rows are packed once, on the rank that generated them (`pack_groups`), with their GRPO advantages
(a group's rows are generated together, so the rank has the whole group). `distribute` then sends
each row to the rank that trains it (`owners`: balanced by tokens), with a handful of all-to-all
collectives of compact tensors, so every rank holds only its own rows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.advantages import grpo_advantages
from m2po_cli.distributed import gather, transfer_device
from m2po_cli.learner.batch import Batch
from m2po_cli.rollout.types import Completion


@dataclass
class PackedRollouts:
    """Some rows of one rollout batch, in increasing `row_B` order. `version` is the oldest policy
    version that generated a row; `version_B` is each row's own, the version its request was
    submitted at, and `version_R` each token's (they differ only in separate mode, where a step's
    groups may come from several versions and weights change while a request is in flight)."""

    version: int
    row_B: Tensor  # int64: the row's index in the rollout batch (prompt-major: prompt p, sample g -> p*n+g)
    tokens_N: Tensor  # int32: prompt then response of every row
    offsets_B1: Tensor  # int64, B + 1 entries: where each row starts in tokens_N
    prompt_len_B: Tensor  # int64
    behaviour_R: Tensor  # float32: the engine's logprob of each response token
    learner_R: Tensor  # float32: the learner's, at `version` (empty until scored, if ever)
    advantages_B: Tensor  # float32: the row's GRPO advantage
    rewards_B: Tensor  # float32
    finished_B: Tensor  # bool: stopped on EOS rather than on the length limit
    solved_B: Tensor  # bool: some row of the row's group has a reward > 0
    version_B: Tensor  # int64: the policy version the row's request was submitted at
    version_R: Tensor  # int32: the policy version that sampled each response token (>= version_B)
    meta: dict[str, float] = field(default_factory=dict)  # the batch's timings (slowest engine's)

    @property
    def num_rows(self) -> int:
        return self.row_B.numel()

    @property
    def lengths_B(self) -> Tensor:
        return self.offsets_B1.diff()

    @property
    def response_len_B(self) -> Tensor:
        return self.lengths_B - self.prompt_len_B

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def response_offsets(self) -> Tensor:
        """Where each row's response logprobs start in `behaviour_R` / `learner_R`; B + 1 entries."""
        return torch.nn.functional.pad(self.response_len_B.cumsum(0), (1, 0))

    def response_index(self, index_K: Tensor) -> Tensor:
        """Where the response tokens of the rows at local positions `index_K` are in the `_R`
        tensors, row after row."""
        index_K = index_K.long()
        return _segments(self.response_offsets()[index_K], self.response_len_B[index_K])

    def take(self, index_K: Tensor) -> PackedRollouts:
        """Rows at local positions `index_K`, in that order."""
        index_K = index_K.long()
        lengths_K = self.lengths_B[index_K]
        tokens = self.tokens_N[_segments(self.offsets_B1[index_K], lengths_K)]
        resp = self.response_index(index_K)
        return replace(
            self,
            row_B=self.row_B[index_K],
            tokens_N=tokens,
            offsets_B1=torch.nn.functional.pad(lengths_K.cumsum(0), (1, 0)),
            prompt_len_B=self.prompt_len_B[index_K],
            behaviour_R=self.behaviour_R[resp],
            learner_R=self.learner_R[resp] if self.learner_R.numel() else self.learner_R,
            advantages_B=self.advantages_B[index_K],
            rewards_B=self.rewards_B[index_K],
            finished_B=self.finished_B[index_K],
            solved_B=self.solved_B[index_K],
            version_B=self.version_B[index_K],
            version_R=self.version_R[resp],
            meta=dict(self.meta),
        )

    @staticmethod
    def cat(parts: list[PackedRollouts], row_B: Tensor) -> PackedRollouts:
        """The rows of `parts`, one after the other, renumbered `row_B`; `version` is the oldest."""
        lengths_B = torch.cat([p.lengths_B for p in parts])
        per_row = [
            f.name for f in fields(PackedRollouts) if f.name not in ("version", "meta", "row_B", "offsets_B1")
        ]
        tensors = {name: torch.cat([getattr(p, name) for p in parts]) for name in per_row}
        return PackedRollouts(
            version=min(p.version for p in parts),
            row_B=row_B,
            offsets_B1=torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0)),
            **tensors,
        )

    def to_batch(self, index_K: Tensor, behaviour: str = "engine") -> Batch:
        """Right-padded `[K, L]` tensors of the rows at local positions `index_K` (prompt + response).

        `behaviour` picks the behaviour logprobs: the engine's, or the learner's at `version`.
        """
        rows = self.take(index_K)
        logprobs_R = rows.behaviour_R if behaviour == "engine" else rows.learner_R
        lengths_K = rows.lengths_B
        num_rows, length = rows.num_rows, int(lengths_K.max()) if rows.num_rows else 1
        position_N = torch.arange(rows.tokens_N.numel()) - torch.repeat_interleave(
            rows.offsets_B1[:-1], lengths_K
        )
        row_N = torch.repeat_interleave(torch.arange(num_rows), lengths_K)
        tokens_KL = torch.zeros(num_rows, length, dtype=torch.long)
        tokens_KL[row_N, position_N] = rows.tokens_N.long()
        is_response_N = position_N >= rows.prompt_len_B[row_N]
        mask_KL = torch.zeros(num_rows, length)
        mask_KL[row_N[is_response_N], position_N[is_response_N]] = 1.0
        behaviour_KL = torch.zeros(num_rows, length)
        behaviour_KL[row_N[is_response_N], position_N[is_response_N]] = logprobs_R
        return Batch(
            tokens_KL,
            mask_KL,
            behaviour_KL,
            rows.advantages_B.clone(),
            lengths_K.clone(),
            rows.row_B.clone(),
            rows.prompt_len_B.clone(),
        )

    # --- as tensors: checkpoints and collectives ---------------------------------------------------

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("version", "meta")}

    @classmethod
    def from_tensors(cls, version: int, tensors: dict[str, Tensor], meta: dict[str, float]) -> PackedRollouts:
        if "version_B" not in tensors:  # written before rows carried their version: all rows share it
            tensors = {**tensors, "version_B": torch.full_like(tensors["row_B"], version)}
        if "version_R" not in tensors:  # written before tokens carried theirs: each row's own
            responses_B = tensors["offsets_B1"].diff() - tensors["prompt_len_B"]
            tensors = {**tensors, "version_R": tensors["version_B"].repeat_interleave(responses_B).int()}
        return cls(version=version, meta=meta, **tensors)

    @classmethod
    def empty(cls, version: int) -> PackedRollouts:
        """No rows: what a rank that generated nothing contributes to `distribute`."""
        long, flt = torch.zeros(0, dtype=torch.long), torch.zeros(0)
        return cls(
            version,
            long,
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(1, dtype=torch.long),
            long,
            flt,
            flt,
            flt,
            flt,
            torch.zeros(0, dtype=torch.bool),
            torch.zeros(0, dtype=torch.bool),
            long,
            torch.zeros(0, dtype=torch.int32),
        )


def _segments(starts_K: Tensor, lengths_K: Tensor) -> Tensor:
    """Flat indices of the segments [start, start + length), concatenated."""
    total = int(lengths_K.sum())
    ends_K = lengths_K.cumsum(0)
    shift_K = starts_K - (ends_K - lengths_K)
    return torch.arange(total) + torch.repeat_interleave(shift_K, lengths_K, output_size=total)


def pack_groups(
    version: int,
    first_row: int,
    prompts: list[list[int]],
    groups: list[list[Completion]],
    rewards_PG: Tensor,
    normalize_std: bool,
    std_eps: float,
) -> PackedRollouts:
    """Pack P prompts x n completions generated on this rank; their rows start at `first_row`."""
    samples = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    tokens = [t for p, c in samples for t in (*p, *c.token_ids)]
    lengths = torch.tensor([len(p) + len(c.token_ids) for p, c in samples], dtype=torch.long)
    advantages_PG = grpo_advantages(rewards_PG, normalize_std, std_eps)
    n = rewards_PG.shape[1]
    return PackedRollouts(
        version=version,
        row_B=torch.arange(first_row, first_row + len(samples)),
        tokens_N=torch.tensor(tokens, dtype=torch.int32),
        offsets_B1=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)),
        prompt_len_B=torch.tensor([len(p) for p, _ in samples], dtype=torch.long),
        behaviour_R=torch.tensor([x for _, c in samples for x in c.logprobs], dtype=torch.float32),
        learner_R=torch.zeros(0),
        advantages_B=advantages_PG.flatten().float(),
        rewards_B=rewards_PG.flatten().float().clone(),
        finished_B=torch.tensor([c.finished for _, c in samples], dtype=torch.bool),
        solved_B=(rewards_PG.max(dim=1).values > 0).repeat_interleave(n),
        version_B=torch.full((len(samples),), version, dtype=torch.long),
        version_R=torch.tensor(
            [v for _, c in samples for v in (c.versions or [version] * len(c.token_ids))], dtype=torch.int32
        ),
    )


def owners(row_B: Tensor, lengths_B: Tensor, rows_per_update: int, world: int) -> Tensor:
    """The rank that trains each row, balanced by tokens: each update's rows are dealt longest first
    (equal lengths by row number) to the rank with the fewest tokens so far (then the fewest rows,
    then the lowest rank). Any two ranks' tokens in an update then differ by at most one row's
    length; contiguous parts leave the slowest rank 1.1x the mean on i.i.d. long-tailed lengths, and
    more where a prompt's samples are alike. The deal depends on the rows alone, not on their order
    or on which rank holds them."""
    owner_B = torch.empty_like(row_B)
    update_B = row_B // rows_per_update
    rows, lengths = row_B.tolist(), lengths_B.tolist()
    for u in update_B.unique().tolist():
        index = (update_B == u).nonzero().squeeze(1).tolist()
        loads = [(0, 0, rank) for rank in range(world)]  # (tokens, rows, rank): a min-heap
        for i in sorted(index, key=lambda i: (-lengths[i], rows[i])):
            tokens, count, rank = heapq.heappop(loads)
            owner_B[i] = rank
            heapq.heappush(loads, (tokens + lengths[i], count + 1, rank))
    return owner_B


def distribute(
    pack: PackedRollouts, rows_per_update: int, group: dist.ProcessGroup | None = None
) -> PackedRollouts:
    """Send each row to the rank that trains it (`owners`); return the rows this rank owns, in
    `row_B` order.

    A collective: every rank passes its own pack (empty if it generated nothing). Every rank's row
    numbers and lengths are gathered first (16 bytes a row), so all ranks deal the rows alike. Six
    all-to-alls of compact tensors (counts, row fields, tokens, logprobs, versions); `meta` stays
    with the rank that holds it. Tensors travel on the GPU when there is one (`transfer_device`).
    Rows are distributed before the learner scores them, so `learner_R` does not travel.
    """
    assert not pack.learner_R.numel(), "distribute rows before scoring them"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return pack
    device = transfer_device()
    group = dist.group.WORLD if group is None else group
    row_N = gather(pack.row_B, group, via=device)
    owner_N = owners(row_N, gather(pack.lengths_B, group, via=device), rows_per_update, world)
    by_row_N = torch.argsort(row_N)
    owner_B = owner_N[by_row_N[torch.searchsorted(row_N[by_row_N], pack.row_B)]]
    order_B = torch.sort(owner_B * (pack.row_B.max() + 1 if pack.num_rows else 1) + pack.row_B).indices
    send = pack.take(order_B)
    rows_to = torch.bincount(owner_B, minlength=world)
    send_owner_B = owner_B[order_B]
    tokens_to = torch.zeros(world, dtype=torch.long).index_add_(0, send_owner_B, send.lengths_B)
    resp_to = torch.zeros(world, dtype=torch.long).index_add_(0, send_owner_B, send.response_len_B)
    counts_to = torch.stack([rows_to, tokens_to, resp_to])
    counts_from = _all_to_all(counts_to.T.contiguous(), [1] * world, [1] * world, group, device).T
    rows_from, tokens_from, resp_from = (c.tolist() for c in counts_from)
    flags_B = send.finished_B.long() | (send.solved_B.long() << 1)
    ints_B5 = torch.stack([send.row_B, send.lengths_B, send.prompt_len_B, flags_B, send.version_B], dim=1)
    floats_B2 = torch.stack([send.advantages_B, send.rewards_B], dim=1)
    rows_to, tokens_to, resp_to = rows_to.tolist(), tokens_to.tolist(), resp_to.tolist()
    ints = _all_to_all(ints_B5, rows_to, rows_from, group, device)
    floats = _all_to_all(floats_B2, rows_to, rows_from, group, device)
    tokens = _all_to_all(send.tokens_N, tokens_to, tokens_from, group, device)
    behaviour = _all_to_all(send.behaviour_R, resp_to, resp_from, group, device)
    version_R = _all_to_all(send.version_R, resp_to, resp_from, group, device)
    row_B, lengths_B, prompt_len_B, flags_B, version_B = ints.unbind(1)
    received = PackedRollouts(
        version=pack.version,
        row_B=row_B,
        tokens_N=tokens,
        offsets_B1=torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0)),
        prompt_len_B=prompt_len_B,
        behaviour_R=behaviour,
        learner_R=torch.zeros(0),
        advantages_B=floats[:, 0].contiguous(),
        rewards_B=floats[:, 1].contiguous(),
        finished_B=(flags_B & 1).bool(),
        solved_B=(flags_B & 2).bool(),
        version_B=version_B.contiguous(),
        version_R=version_R,
        meta=dict(pack.meta),
    )
    return received.take(torch.sort(received.row_B).indices)


def _all_to_all(x: Tensor, send: list[int], receive: list[int], group, device) -> Tensor:
    """Rows of `x` split by `send` to each rank; `receive[r]` rows come back from rank r."""
    out = x.new_empty((sum(receive), *x.shape[1:]), device=device)
    dist.all_to_all_single(out, x.to(device) if device else x, receive, send, group=group)
    return out.cpu()
