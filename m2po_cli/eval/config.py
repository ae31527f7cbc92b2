"""`m2po eval` configuration: the evaluation protocol and the benchmark definitions, as typed TOML.

Two kinds of file, both parsed into frozen models that reject unknown keys (like recipes):
- `evals/benchmarks.toml`, one `[[benchmark]]` table per benchmark: where its problems come from (a JSONL file under
  `--data-dir` in the schema of `shared/benchmarks`, or a hub dataset for users with a network),
  its field names, its samples per problem and, where the paper used one, its own prompt template.
- an optional eval TOML (`--protocol FILE`) with `[protocol]`, `[engine]` and `[grader]` tables.
  The defaults are the paper's protocol (M2PO, arXiv 2510.01161); precedence is defaults < file <
  `--set key.path=value`, through the loader recipes use (`config.tables`).
This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import model_validator

from m2po_cli.config import PAPER_PROMPT_TEMPLATE, EngineTable, EnvConfig, check_template
from m2po_cli.config.tables import ConfigError, Table, field, load

EVALS_DIR = Path(__file__).resolve().parents[2] / "evals"
BENCHMARKS_TOML = EVALS_DIR / "benchmarks.toml"


class Protocol(Table):
    """What is sampled and how; every field here is part of the result cache's key."""

    prompt_template: str | None = field(
        None,
        "User-turn template, `{problem}` replaced by the problem, sent through the chat template; unset: "
        "each benchmark's own (the paper's template; Gaokao keeps the paper's literal `{{}}` quirk).",
    )
    temperature: float = field(1.0, "Sampling temperature.", ge=0)
    top_p: float = field(0.7, "Nucleus sampling threshold.", gt=0, le=1)
    max_new_tokens: int = field(
        2560, "Longest response, in tokens; clamped per prompt to the model's context length.", ge=1
    )
    max_prompt_tokens: int = field(
        1536, "Prompts longer than this (after the chat template) are skipped and counted.", ge=1
    )
    samples: int | None = field(
        None,
        "Samples per problem for every benchmark; unset: each benchmark's own (AIME 16, others 4).",
        ge=1,
    )
    seed: int = field(
        0,
        "Seed of every sample: each is its own request, seeded by this, the benchmark, the problem and "
        "the sample's index, so results repeat exactly and a resumed evaluation samples what it would have.",
        ge=0,
    )

    @model_validator(mode="after")
    def _check_template(self) -> Protocol:
        if self.prompt_template is not None:
            check_template(self.prompt_template, "prompt_template")
        return self


class EngineOptions(EngineTable):
    """How vLLM runs; not part of the cache key (only `dtype` changes the numerics, slightly)."""

    dtype: Literal["auto", "float32", "bfloat16"] = field(
        "auto", "Weights and activations; auto is float32 on CPU, bfloat16 on GPU."
    )
    gpu_memory_utilization: float = field(
        0.9, "Fraction of GPU memory the engine may take (GPU only; an eval has it to itself).", gt=0, lt=1
    )


class GraderOptions(Table):
    workers: int = field(4, "Grading processes.", ge=1)
    timeout_s: float = field(5.0, "Time limit per sample; a sample that runs out scores 0.", gt=0)


class DataOptions(Table):
    dir: str | None = field(
        None,
        "Folder of the benchmarks' JSONL files (names as in evals/benchmarks.toml); unset: "
        "$M2PO_BENCHMARKS, else the hub. --data-dir overrides it.",
    )


class EvalConfig(Table):
    protocol: Protocol = field(Protocol(), "Sampling protocol (the paper's by default).")
    data: DataOptions = field(DataOptions(), "Where the benchmark problems are read from.")
    engine: EngineOptions = field(EngineOptions(), "vLLM engine settings.")
    grader: GraderOptions = field(GraderOptions(), "Grader pool settings.")
    env: EnvConfig = field(
        EnvConfig(),
        "The environment every sample runs in, as in training's `[env]` (empty: one prompt, one answer); "
        "part of the cache's key.",
    )


class HubSource(Table):
    """A benchmark's copy on the Hugging Face hub (`datasets.load_dataset(path, split=...)`)."""

    path: str = field(..., "Dataset id, or a builder such as `json` together with `data_files`.")
    split: str = field(..., "Split to load.")
    data_files: str | None = field(None, "File URL or path for builder datasets such as `json`.")
    problem_key: str = field("problem", "Field holding the problem text.")
    answer_key: str = field("answer", "Field holding the gold answer.")
    answer_index: int | None = field(None, "The answer field is a list: take this item.", ge=0)
    strip_dollars: bool = field(False, "Remove `$` from the gold answer (as M2PO's preprocessing does).")
    id_key: str | None = field(None, "Field holding a problem id; unset: `<name>-<row index>`.")


class BenchmarkSpec(Table):
    """One `[[benchmark]]` of `evals/benchmarks.toml`."""

    name: str = field(..., "Short name, as used by `--benchmarks`.", pattern=r"^[a-z0-9_-]+$")
    title: str = field(..., "Column header in result tables.", min_length=1)
    file: str = field(..., "JSONL file under `--data-dir` (fields id, problem, answer).")
    num_problems: int = field(..., "Problems in the benchmark (a different count is reported).", ge=1)
    samples: int = field(..., "Samples per problem in the paper's protocol.", ge=1)
    prompt_template: str = field(PAPER_PROMPT_TEMPLATE, "This benchmark's prompt in the paper.")
    hub: HubSource | None = field(None, "Where the problems come from without `--data-dir`.")

    @model_validator(mode="after")
    def _check_template(self) -> BenchmarkSpec:
        check_template(self.prompt_template, "prompt_template")
        return self


# --- loading -------------------------------------------------------------------------------------


def load_eval_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> EvalConfig:
    """Defaults < the eval TOML at `path` < `--set key.path=value` overrides. Raises ConfigError."""
    return load(
        EvalConfig, Path(path) if path is not None else None, overrides, default_source="eval defaults"
    )


class BenchmarkSet(Table):
    benchmark: list[BenchmarkSpec] = field(..., "The benchmarks, in the order of the result tables.")

    @model_validator(mode="after")
    def _check_names(self) -> BenchmarkSet:
        names = [b.name for b in self.benchmark]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"benchmark: name {duplicate!r} is used twice")
        return self


def load_benchmarks(names: list[str] | None = None, path: Path = BENCHMARKS_TOML) -> list[BenchmarkSpec]:
    """The benchmarks defined in `path`: all in file order, or those in `names` in that order."""
    specs = {b.name: b for b in load(BenchmarkSet, path).benchmark}
    if names is None:
        return list(specs.values())
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ConfigError(
            "--benchmarks", "", f"unknown benchmark {unknown[0]!r}; choose from {', '.join(specs)}"
        )
    return [specs[n] for n in names]
