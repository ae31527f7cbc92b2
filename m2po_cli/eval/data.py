"""Benchmark problems for `m2po eval`: a local JSONL file in the benchmark folder, or the hub.

The folder is `--data-dir`, else the eval config's `data.dir`, else `$M2PO_BENCHMARKS`; with none
set, each benchmark is read from its hub dataset.

Local files follow the schema of `shared/benchmarks` (one object a line: `id`, `problem`, `answer`,
more fields ignored). Hub rows are mapped through the benchmark's `[hub]` field names. Either way a
benchmark becomes a list of `EvalProblem` in file order, and `digest` names its content, so cached
results of an edited or different copy are never reused. `BenchPlan` is one benchmark's work for
one target: what is cached, what is skipped, and the `Job`s left to sample.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2po_cli.data import DataError
from m2po_cli.eval.config import BenchmarkSpec, HubSource


@dataclass(frozen=True)
class EvalProblem:
    id: str
    problem: str
    answer: str


BENCHMARKS_ENV = "M2PO_BENCHMARKS"
HOW_TO_POINT = f"point at local files with --data-dir DIR, data.dir in an eval TOML or ${BENCHMARKS_ENV}=DIR"


def benchmark_dir(data_dir: str | None, config_dir: str | None) -> tuple[Path | None, str]:
    """The benchmark folder and what set it: `--data-dir`, else the eval config's `data.dir`, else
    `$M2PO_BENCHMARKS`; (None, "") means the hub."""
    env = os.environ.get(BENCHMARKS_ENV)
    for value, origin in ((data_dir, "--data-dir"), (config_dir, "data.dir"), (env, f"${BENCHMARKS_ENV}")):
        if value:
            return Path(value).expanduser(), origin
    return None, ""


def load_problems(
    spec: BenchmarkSpec, data_dir: Path | None, origin: str = "--data-dir"
) -> list[EvalProblem]:
    """All problems of `spec`, from `data_dir / spec.file` or, without a folder, from the hub.

    `origin` names what set the folder, for the error when the file is not there.
    """
    if data_dir is not None:
        return _read_local(data_dir / spec.file, origin)
    if spec.hub is None:
        raise DataError(f"{spec.name}: no hub source is defined; {HOW_TO_POINT} holding {spec.file}")
    return _read_hub(spec.name, spec.hub, spec.file)


def digest(problems: list[EvalProblem]) -> str:
    """Content hash of a whole benchmark (ids, problems, answers)."""
    text = json.dumps([[p.id, p.problem, p.answer] for p in problems])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_local(path: Path, origin: str) -> list[EvalProblem]:
    if not path.is_file():
        raise DataError(f"{path}: benchmark file not found (folder from {origin})")
    problems = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e}") from None
        missing = [k for k in ("id", "problem", "answer") if not isinstance(row.get(k), str)]
        if missing:
            raise DataError(f"{where}: field {missing[0]!r} must be a string")
        problems.append(EvalProblem(row["id"], row["problem"], row["answer"]))
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise DataError(f"{path}: ids are not unique")
    return problems


def _read_hub(name: str, hub: HubSource, file: str) -> list[EvalProblem]:
    # Imported here: `datasets` takes seconds to import and only hub sources need it.
    import datasets

    try:
        ds = datasets.load_dataset(hub.path, split=hub.split, data_files=hub.data_files)
    except Exception as e:  # offline, moved, gated: `datasets` raises many kinds
        raise DataError(
            f"{name}: no local folder is set and the hub did not provide {hub.path} "
            f"({type(e).__name__}); {HOW_TO_POINT} holding {file}"
        ) from None
    for key in (hub.problem_key, hub.answer_key, hub.id_key):
        if key is not None and key not in ds.column_names:
            raise DataError(f"{name}: {hub.path} has no field {key!r}; fields: {', '.join(ds.column_names)}")
    return [_hub_problem(name, hub, i, row) for i, row in enumerate(ds)]


def _hub_problem(name: str, hub: HubSource, i: int, row: dict[str, Any]) -> EvalProblem:
    answer = row[hub.answer_key]
    if hub.answer_index is not None:
        answer = answer[hub.answer_index]
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # math-ai/amc23 stores 27 as 27.0
    answer = str(answer)
    if hub.strip_dollars:
        answer = answer.replace("$", "")
    problem_id = str(row[hub.id_key]) if hub.id_key is not None else f"{name}-{i}"
    return EvalProblem(problem_id, str(row[hub.problem_key]), answer)


@dataclass
class Job:
    """One prompt and the sample indices it still needs."""

    bench: str
    problem: EvalProblem
    prompt_ids: list[int]
    samples: list[int]
    max_tokens: int


@dataclass
class BenchPlan:
    """One benchmark for one target: what is cached, what is skipped, what is left to sample."""

    spec: BenchmarkSpec
    problems: list[EvalProblem]
    num_samples: int
    cache: Path
    records: dict[tuple[str, int], dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # problem ids whose prompt does not fit
    clamped: int = 0  # prompts whose max_new_tokens was cut to fit the context
    jobs: list[Job] = field(default_factory=list)


def append_records(plans: dict[str, BenchPlan], graded: list[tuple[str, dict]]) -> None:
    """Keep each graded sample's record (benchmark name, record) in its plan and append it to the
    plan's cache file, one write per benchmark: a killed evaluation keeps every sample written."""
    lines: dict[str, list[str]] = {}
    for bench, record in graded:
        plans[bench].records[(record["problem_id"], record["sample"])] = record
        lines.setdefault(bench, []).append(json.dumps(record, ensure_ascii=False) + "\n")
    for bench, bench_lines in lines.items():
        with open(plans[bench].cache, "a") as f:
            f.write("".join(bench_lines))
