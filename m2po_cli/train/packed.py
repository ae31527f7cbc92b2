"""Packed rollouts: the rows of a rollout batch as flat tensors with offsets.

A row is one sampled response with its prompt. `tokens_N` holds every row's prompt then response,
concatenated; row b spans `tokens_N[offsets_B1[b] : offsets_B1[b + 1]]`, its first `prompt_len_B[b]`
tokens are the prompt. Per-token values exist only for response tokens, row after row (R = the
rows' response tokens): `behaviour_R` (the engine's logprob at sampling time), `version_R` (the
weight version that sampled the token), `trained_R` (whether the loss trains the token: the tokens
a policy sampled are, a span an environment wrote is not) and `learner_R` (the learner's
recomputation at the generating version, on trained tokens, empty unless
`algorithm.behaviour_logprobs = "learner"`). A row costs 4 bytes per token plus 9 (or 13) per
response token plus 46 bytes; texts, answers and problem ids are not kept (the grader has read them
on the rank that generated the row).

Each field is declared once with its axis (`ROW`, `TOKEN`, `RESPONSE`): taking rows, joining
batches, an empty batch, the all-to-alls of `distribute` and the checkpoint format are generic over
the fields, so a new per-token field is one declaration.

Rows are packed once, on the rank that generated them (`train/pack.py`), with their GRPO advantages
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

from m2po_cli.distributed import all_to_all_rows, as_bytes, from_bytes, gather, transfer_device
from m2po_cli.learner.batch import Batch
from m2po_cli.schedule import Schedule

ROW, TOKEN, RESPONSE = "row", "token", "response"  # one value per row, per token, per response token


def column(axis: str, dtype: torch.dtype, optional: bool = False):
    """A tensor field of `PackedRollouts` along `axis`; an `optional` one may be empty (not computed)."""
    return field(metadata={"axis": axis, "dtype": dtype, "optional": optional})


@dataclass
class PackedRollouts:
    """Some rows of one rollout batch, in increasing `row_B` order. `version` is the oldest policy
    version that generated a row; `version_B` is each row's own, the version its request was
    submitted at, and `version_R` each token's (they differ only in separate mode, where a step's
    groups may come from several versions and weights change while a request is in flight)."""

    version: int
    # the row's index in the rollout batch (prompt-major: prompt p, sample g -> p*n+g)
    row_B: Tensor = column(ROW, torch.int64)
    tokens_N: Tensor = column(TOKEN, torch.int32)  # prompt then response of every row
    offsets_B1: Tensor = field()  # int64, B + 1 entries: where each row starts in tokens_N
    prompt_len_B: Tensor = column(ROW, torch.int64)
    behaviour_R: Tensor = column(RESPONSE, torch.float32)  # the engine's logprob of each response token
    # the learner's logprob at `version` of each response token (0 on untrained ones; empty until scored)
    learner_R: Tensor = column(RESPONSE, torch.float32, optional=True)
    advantages_B: Tensor = column(ROW, torch.float32)  # the row's GRPO advantage
    rewards_B: Tensor = column(ROW, torch.float32)
    finished_B: Tensor = column(ROW, torch.bool)  # stopped on EOS rather than on the length limit
    solved_B: Tensor = column(ROW, torch.bool)  # some row of the row's group has a reward > 0
    version_B: Tensor = column(ROW, torch.int64)  # the policy version the row's request was submitted at
    # the policy version that sampled each response token (>= version_B)
    version_R: Tensor = column(RESPONSE, torch.int32)
    trained_R: Tensor = column(RESPONSE, torch.bool)  # the loss trains the token
    tool_calls_B: Tensor = column(ROW, torch.int16)  # the episode's tool calls (0 without an environment)
    tool_failures_B: Tensor = column(ROW, torch.int16)  # those that answered with an error
    meta: dict[str, float] = field(default_factory=dict)  # the batch's timings (slowest engine's)

    @staticmethod
    def columns(axis: str | None = None, optional: bool | None = None) -> list[str]:
        """The names of the tensor fields along `axis` (any: None), optional or not (either: None),
        in declaration order."""
        return [
            name
            for name, spec in COLUMNS.items()
            if axis in (None, spec["axis"]) and optional in (None, spec["optional"])
        ]

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
    def owner_R(self) -> Tensor:
        """The local row of each response token."""
        return torch.repeat_interleave(torch.arange(self.num_rows), self.response_len_B)

    @property
    def trained_len_B(self) -> Tensor:
        """The trained tokens of each row."""
        return torch.zeros(self.num_rows, dtype=torch.long).index_add_(0, self.owner_R, self.trained_R.long())

    @property
    def turn_R(self) -> Tensor:
        """The model turn of each response token, from 0 (an environment's token: the turn before it):
        the runs of trained tokens begun so far in its row, less one."""
        starts_R = self.trained_R.clone()
        starts_R[1:] &= ~self.trained_R[:-1]  # a trained token after an untrained one (or none) ...
        firsts_B = self.response_offsets()[:-1][self.response_len_B > 0]
        starts_R[firsts_B] = self.trained_R[firsts_B]  # ... or a row's first
        count_R = starts_R.long().cumsum(0)
        earlier_B = torch.nn.functional.pad(count_R, (1, 0))[self.response_offsets()[:-1]]
        return (count_R - earlier_B[self.owner_R] - 1).clamp(min=0)

    @property
    def turns_B(self) -> Tensor:
        """The model turns of each row's episode (1 for a one-turn row)."""
        turns_B = torch.zeros(self.num_rows, dtype=torch.long)
        return turns_B.scatter_reduce_(0, self.owner_R, self.turn_R + 1, "amax")

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

    def trained_index(self, index_K: Tensor) -> Tensor:
        """`response_index(index_K)` restricted to the trained tokens."""
        index_R = self.response_index(index_K)
        return index_R[self.trained_R[index_R]]

    def take(self, index_K: Tensor) -> PackedRollouts:
        """Rows at local positions `index_K`, in that order."""
        index_K = index_K.long()
        lengths_K = self.lengths_B[index_K]
        along = {
            ROW: index_K,
            TOKEN: _segments(self.offsets_B1[index_K], lengths_K),
            RESPONSE: self.response_index(index_K),
        }
        taken = {
            name: getattr(self, name)[along[spec["axis"]]]
            if not spec["optional"] or self.has(name)
            else empty_column(name)
            for name, spec in COLUMNS.items()
        }
        return replace(self, **taken, offsets_B1=offsets(lengths_K), meta=dict(self.meta))

    @classmethod
    def cat(cls, parts: list[PackedRollouts], row_B: Tensor) -> PackedRollouts:
        """The rows of `parts`, one after the other, renumbered `row_B`; `version` is the oldest. An
        optional field is kept only where every part has it."""
        joined = {
            name: torch.cat([getattr(p, name) for p in parts])
            if all(p.has(name) for p in parts)
            else empty_column(name)
            for name in cls.columns()
            if name != "row_B"
        }
        return cls(
            version=min(p.version for p in parts),
            row_B=row_B,
            offsets_B1=offsets(torch.cat([p.lengths_B for p in parts])),
            **joined,
        )

    def has(self, name: str) -> bool:
        """Whether the field `name` holds a value for each of its positions (an optional one may not)."""
        axis = COLUMNS[name]["axis"]
        size = {ROW: self.num_rows, TOKEN: self.tokens_N.numel(), RESPONSE: int(self.response_len_B.sum())}
        return getattr(self, name).numel() == size[axis]

    def to_batch(self, index_K: Tensor, behaviour: str = "engine") -> Batch:
        """Right-padded `[K, L]` tensors of the rows at local positions `index_K` (prompt + response);
        the mask marks the trained response tokens, and the behaviour logprobs are 0 off it.

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
        trained_N = torch.zeros_like(is_response_N)
        trained_N[is_response_N] = rows.trained_R
        mask_KL = torch.zeros(num_rows, length)
        mask_KL[row_N[trained_N], position_N[trained_N]] = 1.0
        behaviour_KL = torch.zeros(num_rows, length)
        behaviour_KL[row_N[trained_N], position_N[trained_N]] = logprobs_R[rows.trained_R]
        return Batch(
            tokens_KL,
            mask_KL,
            behaviour_KL,
            rows.advantages_B.clone(),
            lengths_K.clone(),
            rows.row_B.clone(),
            rows.prompt_len_B.clone(),
        )

    def set_learner_logprobs(self, logprobs_BL: Tensor, mask_BL: Tensor) -> None:
        """Keep the learner's logprobs of every row (`to_batch` of all rows, scored) as `learner_R`:
        on the trained tokens (`mask_BL`), 0 on the others."""
        self.learner_R = torch.zeros_like(self.behaviour_R)
        self.learner_R[self.trained_R] = logprobs_BL[mask_BL]

    # --- as tensors: checkpoints and collectives ---------------------------------------------------

    def tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in ["offsets_B1", *self.columns()]}

    @classmethod
    def from_tensors(cls, version: int, tensors: dict[str, Tensor], meta: dict[str, float]) -> PackedRollouts:
        responses_B = tensors["offsets_B1"].diff() - tensors["prompt_len_B"]
        if "version_B" not in tensors:  # written before rows carried their version: all rows share it
            tensors = {**tensors, "version_B": torch.full_like(tensors["row_B"], version)}
        if "version_R" not in tensors:  # written before tokens carried theirs: each row's own
            tensors = {**tensors, "version_R": tensors["version_B"].repeat_interleave(responses_B).int()}
        if "trained_R" not in tensors:  # written before tokens carried the flag: every one trained
            tensors = {**tensors, "trained_R": torch.ones(int(responses_B.sum()), dtype=torch.bool)}
        for name in ("tool_calls_B", "tool_failures_B"):  # written before episodes: one turn, no tools
            tensors.setdefault(name, torch.zeros_like(tensors["row_B"], dtype=torch.int16))
        return cls(version=version, meta=meta, **tensors)

    @classmethod
    def empty(cls, version: int) -> PackedRollouts:
        """No rows: what a rank that generated nothing contributes to `distribute`."""
        return cls(
            version, offsets_B1=torch.zeros(1, dtype=torch.long), **{n: empty_column(n) for n in COLUMNS}
        )


# Each tensor field's declaration (`column`): its axis, dtype and whether it may be empty.
COLUMNS = {f.name: f.metadata for f in fields(PackedRollouts) if "axis" in f.metadata}


def empty_column(name: str) -> Tensor:
    """An empty tensor of the field `name`'s dtype."""
    return torch.zeros(0, dtype=COLUMNS[name]["dtype"])


def offsets(lengths_B: Tensor) -> Tensor:
    """Where each row starts, for rows of `lengths_B`: B + 1 entries from 0."""
    return torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0))


def _segments(starts_K: Tensor, lengths_K: Tensor) -> Tensor:
    """Flat indices of the segments [start, start + length), concatenated."""
    total = int(lengths_K.sum())
    ends_K = lengths_K.cumsum(0)
    shift_K = starts_K - (ends_K - lengths_K)
    return torch.arange(total) + torch.repeat_interleave(shift_K, lengths_K, output_size=total)


def owners(row_B: Tensor, lengths_B: Tensor, schedule: Schedule, world: int) -> Tensor:
    """The rank that trains each row, balanced by tokens: each update's rows are dealt longest first
    (equal lengths by row number) to the rank with the fewest tokens so far (then the fewest rows,
    then the lowest rank). Any two ranks' tokens in an update then differ by at most one row's
    length; contiguous parts leave the slowest rank 1.1x the mean on i.i.d. long-tailed lengths, and
    more where a prompt's samples are alike. The deal depends on the rows alone, not on their order
    or on which rank holds them."""
    owner_B = torch.empty_like(row_B)
    update_B = schedule.mini_batch_of(row_B)
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
    pack: PackedRollouts, schedule: Schedule, group: dist.ProcessGroup | None = None
) -> PackedRollouts:
    """Send each row to the rank that trains it (`owners`); return the rows this rank owns, in
    `row_B` order.

    A collective: every rank passes its own pack (empty if it generated nothing). Every rank's row
    numbers and lengths are gathered first (16 bytes a row), so all ranks deal the rows alike. Then
    one all-to-all of the counts and one per axis, each carrying that axis's fields as raw bytes
    (per row: the length and every row field, 46 bytes; per token: 4; per response token: 9);
    `meta` stays with the rank that holds it. Tensors travel on the GPU when there is one
    (`transfer_device`). Rows are distributed before the learner scores them, so the optional
    fields (`learner_R`) do not travel.
    """
    optional = PackedRollouts.columns(optional=True)
    assert not any(getattr(pack, n).numel() for n in optional), "distribute rows before scoring them"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return pack
    device = transfer_device()
    group = dist.group.WORLD if group is None else group
    row_N = gather(pack.row_B, group, via=device)
    owner_N = owners(row_N, gather(pack.lengths_B, group, via=device), schedule, world)
    by_row_N = torch.argsort(row_N)
    owner_B = owner_N[by_row_N[torch.searchsorted(row_N[by_row_N], pack.row_B)]]
    order_B = torch.sort(owner_B * (pack.row_B.max() + 1 if pack.num_rows else 1) + pack.row_B).indices
    send, send_owner_B = pack.take(order_B), owner_B[order_B]

    def per_rank(values: Tensor) -> Tensor:
        return torch.zeros(world, dtype=torch.long).index_add_(0, send_owner_B, values)

    counts_to = torch.stack(
        [per_rank(torch.ones_like(send_owner_B)), per_rank(send.lengths_B), per_rank(send.response_len_B)]
    )
    counts_from = all_to_all_rows(counts_to.T.contiguous(), [1] * world, [1] * world, group, device).T
    sizes = {
        axis: (to.tolist(), came.tolist())
        for axis, to, came in zip((ROW, TOKEN, RESPONSE), counts_to, counts_from, strict=True)
    }
    travelling = {axis: PackedRollouts.columns(axis, optional=False) for axis in sizes}
    travelling[ROW] = ["lengths_B", *travelling[ROW]]
    received: dict[str, Tensor] = {}
    for axis, names in travelling.items():
        values = [getattr(send, n) for n in names]
        came = all_to_all_rows(as_bytes(values), *sizes[axis], group, device)
        received |= from_bytes(came, names, [v.dtype for v in values])
    lengths_B = received.pop("lengths_B")
    rows = PackedRollouts(
        version=pack.version,
        offsets_B1=offsets(lengths_B),
        **received,
        **{n: empty_column(n) for n in PackedRollouts.columns(optional=True)},
        meta=dict(pack.meta),
    )
    return rows.take(torch.sort(rows.row_B).indices)
