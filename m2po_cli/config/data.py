"""The recipe's `[model]`, `[data]` and `[reward]` tables: what is trained, on which prompts, scored how."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, model_validator

from m2po_cli.config.tables import Table, checks_files, field
from m2po_cli.models import BUILTIN_NAMES, HUB_ID, model_source

PAPER_PROMPT_TEMPLATE = (
    "Please solve the following math problem: {problem}. The assistant first thinks about the "
    "reasoning process step by step and then provides the user with the answer. Return the final "
    "answer in \\boxed{{}} tags, for example \\boxed{{1}}. Let's solve this step by step. "
)
SYNTHETIC_SOURCES = ("synthetic:arithmetic",)


def check_template(template: str, key: str) -> None:
    """The prompt-template rule of recipes and eval configs: `template.format(problem=...)` must work
    with `problem` alone; literal braces are written `{{` and `}}`. Raises ValueError("key: ...")."""
    if "{problem}" not in template:
        raise ValueError(f"{key}: must contain {{problem}}")
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{key}: {e!r}; write literal braces as {{{{ and }}}}") from None


class ModelConfig(Table):
    path: str = field(
        ...,
        "Model: a local HF-format directory, a hub id (org/name), or a builtin "
        f"({', '.join(BUILTIN_NAMES)}) built offline and cached.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = field(
        "auto",
        "Dtype of rollouts and of the learner's matmuls (master weights stay float32); auto is float32 "
        "on CPU, bfloat16 on GPU. The HF export is bfloat16 only when this is bfloat16.",
    )

    @model_validator(mode="after")
    def _check_path(self, info: ValidationInfo) -> ModelConfig:
        if not checks_files(info):  # a run directory read elsewhere: its model's folder may not be here
            return self
        try:
            model_source(self.path)
        except ValueError as e:
            raise ValueError(f"path: {e}") from None
        return self


class SyntheticConfig(Table):
    max_operand: int = field(9, "Largest operand of the synthetic arithmetic problems.", ge=1, le=10**6)
    num_operands: int = field(2, "Operands per synthetic problem (a + b + ...).", ge=1, le=8)
    num_problems: int = field(10_000, "Size of the synthetic prompt set.", ge=1)


class DataConfig(Table):
    source: str = field(
        ..., "Prompts: a local .jsonl/.json/.parquet file, a hub dataset id, or synthetic:arithmetic."
    )
    split: str = field("train", "Dataset split when `source` is a hub id.")
    prompt_key: str = field("problem", "Field holding the problem text.")
    answer_key: str = field("answer", "Field holding the ground-truth answer.")
    prompt_template: str = field(
        PAPER_PROMPT_TEMPLATE, "User-turn template; `{problem}` is replaced by the problem text."
    )
    shuffle_seed: int = field(42, "Seed of the one-off shuffle of the prompt set.", ge=0)
    max_prompt_tokens: int = field(
        1536, "Prompts longer than this (after the chat template) are dropped.", ge=1
    )
    synthetic: SyntheticConfig = field(SyntheticConfig(), "Options of the synthetic arithmetic task.")

    @model_validator(mode="after")
    def _check_source(self, info: ValidationInfo) -> DataConfig:
        s = self.source
        if s.startswith("synthetic:"):
            if s not in SYNTHETIC_SOURCES:
                raise ValueError(
                    f"source: unknown synthetic task {s!r}; choose one of {', '.join(SYNTHETIC_SOURCES)}"
                )
        elif s.endswith((".jsonl", ".json", ".parquet")):
            if checks_files(info) and not Path(s).expanduser().is_file():
                raise ValueError(f"source: file not found: {s}")
        elif not HUB_ID.match(s):
            raise ValueError(
                f"source: {s!r} is neither a .jsonl/.json/.parquet file, a hub id nor synthetic:arithmetic"
            )
        check_template(self.prompt_template, "prompt_template")
        return self


class RewardConfig(Table):
    function: str = field(
        "",
        "A Python reward, `package.module:name`, called once per group as name(prompt, completions, "
        "answer, **columns): the problem text, the n response texts, the gold answer and the row's "
        "other dataset fields; it returns one number per completion. It runs in the grader's worker "
        "processes within timeout_s (past it the group scores 0). Empty: the built-in math grader "
        "(what `m2po eval` always scores with).",
    )
    timeout_s: float = field(
        5.0,
        "Seconds one grading call may take before it scores 0: a response (math grader) or a group (function).",
        gt=0,
    )

    @model_validator(mode="after")
    def _check_function(self) -> RewardConfig:
        if self.function and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.function):
            raise ValueError(f"function: {self.function!r} is not `package.module:name`")
        return self
