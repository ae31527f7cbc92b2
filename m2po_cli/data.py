"""Prompt sets for training: load problems, render them as chat prompts, batch them resumably.

A problem set comes from `DataConfig.source`: a local .jsonl / .json (a list of records) /
.parquet file, a hub dataset id, or `synthetic:arithmetic`. `PromptBatches` walks a seeded
permutation of the set in batches of `prompts_per_step` and tokenizes lazily, one batch at a time,
so a 40k-problem set costs nothing up front. Its whole state is (epoch, position).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m2po_cli.config import DataConfig, SyntheticConfig
from m2po_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DataError(UserError):
    """A user-fixable problem with the prompt set (one line, naming the file, record and field)."""


@dataclass(frozen=True)
class Problem:
    """One problem: `index` is its position in the loaded set, a stable id within that set;
    `columns` its record's other fields (kept for `reward.function` only)."""

    index: int
    problem: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Prompt:
    """A problem and its prompt as token ids (chat template applied, generation prompt added)."""

    problem: Problem
    token_ids: list[int]


# --- loading -------------------------------------------------------------------------------------


def load_problems(cfg: DataConfig, columns: bool = False) -> list[Problem]:
    """The problem set named by `cfg.source`, in file order. Raises DataError.

    `synthetic:arithmetic` is generated from `cfg.synthetic` and `cfg.shuffle_seed`, so the recipe
    alone fixes the set (not `run.seed`). `columns`: keep each record's other fields (a reward
    function reads them); otherwise only the problem and the answer are kept.
    """
    if cfg.source.startswith("synthetic:"):
        return synthetic_arithmetic(cfg.synthetic, seed=cfg.shuffle_seed)
    records = _read_records(cfg, columns)
    if not records:
        raise DataError(f"{cfg.source}: no records")
    return [_to_problem(i, rec, cfg, columns) for i, rec in enumerate(records)]


def is_hub(cfg: DataConfig) -> bool:
    """True when `cfg.source` is a hub dataset (reading it needs the network), not a file or a task."""
    return not cfg.source.startswith("synthetic:") and not cfg.source.endswith(
        (".jsonl", ".json", ".parquet")
    )


def synthetic_arithmetic(cfg: SyntheticConfig, seed: int) -> list[Problem]:
    """`num_problems` sums such as `3+4` of `num_operands` integers in [0, max_operand]; answer the sum."""
    rng = random.Random(f"synthetic:arithmetic:{seed}")
    problems = []
    for i in range(cfg.num_problems):
        operands = [rng.randint(0, cfg.max_operand) for _ in range(cfg.num_operands)]
        problems.append(Problem(i, "+".join(map(str, operands)), str(sum(operands))))
    return problems


def _read_records(cfg: DataConfig, columns: bool) -> list[Any]:
    source = cfg.source
    path = Path(source).expanduser()
    if source.endswith(".jsonl"):
        return _read_jsonl(path)
    if source.endswith(".json"):
        try:
            records = json.loads(_text(path))
        except json.JSONDecodeError as e:
            raise DataError(f"{source}: invalid JSON: {e}") from None
        if not isinstance(records, list):
            raise DataError(f"{source}: expected a JSON list of records, got {type(records).__name__}")
        return records
    if source.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except pyarrow.ArrowException as e:
            raise DataError(f"{source}: not a readable parquet file: {str(e).splitlines()[0]}") from None
    return _read_hub(cfg, columns)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); expected JSON") from None


def _read_jsonl(path: Path) -> list[Any]:
    records = []
    for line_no, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {line_no}: invalid JSON: {e}") from None
    return records


def _read_hub(cfg: DataConfig, columns: bool) -> list[Any]:
    # Imported here: `datasets` takes seconds to import and only hub sources need it.
    import datasets

    ds = datasets.load_dataset(cfg.source, split=cfg.split)
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in ds.column_names:
            raise DataError(
                f"{cfg.source} (split {cfg.split}): no field {key!r}; fields: {', '.join(ds.column_names)}"
            )
    if columns:
        return ds.to_list()
    # Only the two columns: hub sets often carry long solutions we would copy for nothing.
    return ds.select_columns([cfg.prompt_key, cfg.answer_key]).to_list()


def _to_problem(i: int, record: Any, cfg: DataConfig, columns: bool) -> Problem:
    where = f"{cfg.source}: record {i}"
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in record:
            raise DataError(f"{where}: missing field {key!r} (fields: {', '.join(map(str, record))})")
    problem, answer = record[cfg.prompt_key], record[cfg.answer_key]
    if not isinstance(problem, str):
        raise DataError(f"{where}: field {cfg.prompt_key!r} must be a string, got {type(problem).__name__}")
    # Numeric golds (AIME-style ints) are common; anything else is ambiguous for the grader.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DataError(
            f"{where}: field {cfg.answer_key!r} must be a string or a number, got {type(answer).__name__}"
        )
    extra = {k: v for k, v in record.items() if k not in (cfg.prompt_key, cfg.answer_key)} if columns else {}
    return Problem(i, problem, str(answer), extra)


# --- prompts -------------------------------------------------------------------------------------


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    problem: str,
    opening: Sequence[dict] = (),
    tools: list[dict] | None = None,
) -> list[int]:
    """`template.format(problem=...)` as one user turn through the chat template -> token ids. An
    environment's `opening` messages follow it, and its `tools` go to the template."""
    content = template.format(problem=problem)
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}, *opening],
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    # transformers 5 returns a BatchEncoding; ask for the dict form explicitly and take the ids.
    ids = list(encoded["input_ids"])
    assert all(isinstance(t, int) for t in ids), "chat template returned a batch, not one sequence"
    return ids


class PromptBatches:
    """Endless, deterministic, resumable batches of `prompts_per_step` prompts.

    Epoch e walks a permutation of the set seeded by (`shuffle_seed`, e). Prompts longer than
    `max_prompt_tokens` are skipped (and remembered: `num_dropped` counts those met so far), and
    the next problem of the permutation takes the place. The tail of an epoch that cannot fill a
    whole batch is dropped, so every batch holds distinct problems of one epoch. `state_dict()` is
    (epoch, position in that epoch's permutation); loading it replays exactly the same next batches.
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        prompts_per_step: int,
        opening: Callable[[Problem], list[dict]] | None = None,
        tools: list[dict] | None = None,
    ):
        if len(problems) < prompts_per_step:
            raise DataError(
                f"{cfg.source}: {len(problems)} problems, fewer than prompts_per_step={prompts_per_step}"
            )
        self.problems, self.tokenizer, self.cfg = problems, tokenizer, cfg
        self.prompts_per_step = prompts_per_step
        self.opening, self.tools = opening, tools  # an environment's first messages and tools
        self.epoch = self.position = 0
        self._too_long: set[int] = set()  # indices into `problems`
        self._order_epoch, self._order = -1, []

    @property
    def num_dropped(self) -> int:
        """Distinct problems skipped so far for exceeding `max_prompt_tokens`."""
        return len(self._too_long)

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> list[Prompt]:
        batch: list[Prompt] = []
        epochs_started = 0
        while len(batch) < self.prompts_per_step:
            order = self._permutation(self.epoch)
            if self.position == len(order):
                epochs_started += 1
                if epochs_started == 2:  # a whole epoch scanned without filling one batch
                    self._raise_too_few()
                self.epoch, self.position, batch = self.epoch + 1, 0, []
                continue
            prompt = self._encode(order[self.position])
            self.position += 1
            if prompt is not None:
                batch.append(prompt)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = state["epoch"], state["position"]
        if not (epoch >= 0 and 0 <= position <= len(self.problems)):
            raise DataError(
                f"data state (epoch {epoch}, position {position}) does not fit this set of "
                f"{len(self.problems)} problems; was the checkpoint made with another data.source?"
            )
        self.epoch, self.position = epoch, position

    def prompt_of(self, index: int) -> Prompt:
        """The prompt of problem `index` (one that fitted `max_prompt_tokens` when it was drawn)."""
        prompt = self._encode(index)
        if prompt is None:
            raise DataError(f"{self.cfg.source}: problem {index} no longer fits data.max_prompt_tokens")
        return prompt

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = list(range(len(self.problems)))
            random.Random(f"{self.cfg.shuffle_seed}:{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def _encode(self, i: int) -> Prompt | None:
        if i in self._too_long:
            return None
        problem = self.problems[i]
        opening = self.opening(problem) if self.opening is not None else ()
        ids = encode_prompt(self.tokenizer, self.cfg.prompt_template, problem.problem, opening, self.tools)
        if len(ids) > self.cfg.max_prompt_tokens:
            self._too_long.add(i)
            return None
        return Prompt(problem, ids)

    def _raise_too_few(self) -> None:
        kept = len(self.problems) - self.num_dropped
        raise DataError(
            f"{self.cfg.source}: only {kept} of {len(self.problems)} prompts fit "
            f"data.max_prompt_tokens={self.cfg.max_prompt_tokens}, fewer than prompts_per_step={self.prompts_per_step}"
        )
