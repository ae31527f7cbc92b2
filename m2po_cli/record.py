"""Token-level records for `m2po inspect`: a bounded sample of what each update trained on.

Every `[inspect] every` steps, each optimizer update of the step records a random sample of its
sequences (whole sequences, about `[inspect] tokens` response tokens), scored by the learner just
before the update: the current logprobs are the ones the loss sees. One
file per recorded step, `inspect/step-NNNNNN.safetensors`, written under a temporary name and renamed,
so a killed run keeps every step it finished and never half a file; a resumed run first drops the
records of the steps it will redo.

Layout (R recorded sequences; N their response tokens, packed sequence after sequence):
    behaviour_logprobs_N  float32  the rollout engine's logprob at sampling time
    learner_logprobs_N    float32  the learner's at the generating version (0 where `scored_R` is false)
    logprobs_N            float32  the learner's at the update, before it
    entropy_N             float32  the learner's entropy at the update, at the sampling temperature
    staleness_N           int64    updates between the version that sampled the token and the update
    turn_N                int64    the episode's model turn the token belongs to (0: the first)
    lengths_R             int64    response tokens of each sequence
    advantages_R          float32  its advantage
    update_R              int64    the update (the policy version it starts from)
    row_R                 int64    the sequence's row in its rollout batch
    scored_R              bool     the learner scored it at the generating version
Metadata: `format`, `step`, and `updates`: JSON, each recorded update's training metrics.
This module needs only torch and safetensors: `m2po inspect` reads records without vLLM or a model.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from m2po_cli.config import InspectConfig
from m2po_cli.errors import UserError

FORMAT = "m2po-inspect-3"
FORMAT_2 = "m2po-inspect-2"  # before episodes: read, every token of the first turn
FORMAT_1 = "m2po-inspect-1"  # staleness per sequence (`staleness_R`): read, each token given its row's
DIR = "inspect"
TOKEN_FIELDS = (
    "behaviour_logprobs_N",
    "learner_logprobs_N",
    "logprobs_N",
    "entropy_N",
    "staleness_N",
    "turn_N",
)
ROW_FIELDS = ("lengths_R", "advantages_R", "update_R", "row_R", "scored_R")


class RecordError(UserError, ValueError):
    """A run directory whose records cannot be read; the message is one line a user can act on."""


@dataclass
class Sample:
    """The recorded sequences of one update (or of several, concatenated): plain tensors."""

    behaviour_logprobs_N: Tensor
    learner_logprobs_N: Tensor
    logprobs_N: Tensor
    entropy_N: Tensor
    staleness_N: Tensor
    turn_N: Tensor
    lengths_R: Tensor
    advantages_R: Tensor
    update_R: Tensor
    row_R: Tensor
    scored_R: Tensor

    @staticmethod
    def cat(samples: list[Sample]) -> Sample:
        fields = TOKEN_FIELDS + ROW_FIELDS
        return Sample(**{f: torch.cat([getattr(s, f) for s in samples]) for f in fields})

    def tensors(self) -> dict[str, Tensor]:
        return {f: getattr(self, f).contiguous() for f in TOKEN_FIELDS + ROW_FIELDS}


def step_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / DIR / f"step-{step:06d}.safetensors"


class Recorder:
    """Chooses the recorded sequences and writes them (rank 0), one file per recorded step."""

    def __init__(self, run_dir: Path, cfg: InspectConfig, seed: int, rank: int, world: int):
        self.run_dir, self.cfg, self.seed = Path(run_dir), cfg, seed
        self.rank, self.world = rank, world
        self.samples: list[Sample] = []
        self.updates: list[dict[str, float]] = []
        self.picked_for: int | None = None  # the update `pick` last chose rows of, until `add`

    def start(self, first_step: int) -> None:
        """Drop records of steps >= `first_step` left by a killed run: the resumed run redoes them."""
        if self.rank != 0 or not (self.run_dir / DIR).is_dir():
            return
        for path in (self.run_dir / DIR).iterdir():
            if path.name.startswith(".") or _step_of(path) >= first_step:
                path.unlink()

    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def pick(self, step: int, update: int, rows: list[int], lengths: list[int]) -> tuple[list[int], bool]:
        """This rank's rows to score for the record of one update, and whether it keeps them.

        Rows are taken in a seeded random order while they fit in `tokens` response tokens (at least
        one; `tokens = 0` takes them all), the same choice on every rank, and split over the ranks
        in batch order, equally (the count is rounded down to a multiple of the world size), so
        every rank runs the same forwards. With fewer rows than ranks, a rank without a row of its
        own scores a copy of one and drops it.
        """
        self.picked_for = update
        if self.cfg.tokens == 0:
            chosen = list(rows)
        else:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + update)
            order = torch.randperm(len(rows), generator=g).tolist()
            total = torch.tensor([lengths[i] for i in order]).cumsum(0)
            count = max(1, int((total <= self.cfg.tokens).sum()))
            count -= count % self.world if count >= self.world else 0
            chosen = sorted(rows[i] for i in order[:count])
        if len(chosen) < self.world:
            return [chosen[self.rank % len(chosen)]], self.rank < len(chosen)
        return torch.tensor_split(torch.tensor(chosen, dtype=torch.long), self.world)[
            self.rank
        ].tolist(), True

    def add(self, sample: Sample | None, metrics: dict[str, float]) -> None:
        """Keep one update's sample (None: no rows on this rank, or not a recorded step) and the
        metrics training logged for the update, if rows of it were picked."""
        if sample is not None:
            self.samples.append(sample)
        if self.picked_for is not None:
            self.updates.append({"update": self.picked_for, **metrics})
            self.picked_for = None

    def write(self, step: int) -> None:
        """Gather every rank's samples of a recorded step, write them (rank 0); a collective."""
        if not self.due(step):
            return
        parts = [self.samples]
        if self.world > 1:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(self.samples, parts, dst=0)
        if self.rank == 0:
            samples = [sample for part in parts for sample in part]
            if samples:
                _write_atomic(step_path(self.run_dir, step), Sample.cat(samples), step, self.updates)
        self.samples, self.updates = [], []


def _write_atomic(path: Path, sample: Sample, step: int, updates: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    metadata = {"format": FORMAT, "step": str(step), "updates": json.dumps(updates)}
    save_file(sample.tensors(), str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-").split(".")[0]) if path.name.startswith("step-") else -1


# --- reading -------------------------------------------------------------------------------------


@dataclass
class Records:
    """Every recorded sequence of a run (or of a range of its steps), with its step."""

    sample: Sample
    step_R: Tensor
    updates: list[dict]  # per recorded update: {"update", "step", training metrics...}


def record_files(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / DIR
    return sorted(root.glob("step-*.safetensors")) if root.is_dir() else []


def load_records(run_dir: Path, steps: range | None = None) -> Records:
    """Read the records of `run_dir` (of the steps in `steps`, if given). Raises RecordError."""
    every = record_files(run_dir)
    files = [p for p in every if steps is None or _step_of(p) in steps]
    if not every:
        raise RecordError(
            f"{run_dir}: no recorded tokens ({DIR}/ holds no step files); a run records every "
            "[inspect] every steps from step 0, unless every = 0"
        )
    if not files:
        recorded = f"{_step_of(every[0])}" + (f"-{_step_of(every[-1])}" if len(every) > 1 else "")
        raise RecordError(
            f"{run_dir}: no recorded tokens in steps {steps.start}:{'' if steps.stop == sys.maxsize else steps.stop} "
            f"(it recorded {len(every)} steps, {recorded})"
        )
    samples, step_parts, updates = [], [], []
    for path in files:
        sample, step, file_updates = _read(path)
        samples.append(sample)
        step_parts.append(torch.full_like(sample.lengths_R, step))
        updates += [{**u, "step": step} for u in file_updates]
    return Records(Sample.cat(samples), torch.cat(step_parts), updates)


def _read(path: Path) -> tuple[Sample, int, list[dict]]:
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise RecordError(f"{path}: unreadable record, partly written or damaged ({e})") from None
    if metadata.get("format") not in (FORMAT, FORMAT_2, FORMAT_1):
        raise RecordError(f"{path}: not an m2po inspect record (format {metadata.get('format')!r})")
    if metadata["format"] == FORMAT_1 and {"staleness_R", "lengths_R"} <= tensors.keys():
        tensors["staleness_N"] = tensors.pop("staleness_R").repeat_interleave(tensors["lengths_R"])
    if metadata["format"] != FORMAT and "staleness_N" in tensors:
        tensors["turn_N"] = torch.zeros_like(tensors["staleness_N"])
    fields = TOKEN_FIELDS + ROW_FIELDS
    sample = Sample(**{f: tensors[f] for f in fields}) if all(f in tensors for f in fields) else None
    if sample is None or not _consistent(sample):
        raise RecordError(f"{path}: damaged record (fields missing or of inconsistent lengths)")
    return sample, int(metadata["step"]), json.loads(metadata["updates"])


def _consistent(sample: Sample) -> bool:
    num_rows, num_tokens = len(sample.lengths_R), int(sample.lengths_R.sum())
    return all(len(getattr(sample, f)) == num_tokens for f in TOKEN_FIELDS) and all(
        len(getattr(sample, f)) == num_rows for f in ROW_FIELDS
    )
