"""The recipe's `[env]` table: the environment an episode runs in, and its limits."""

from __future__ import annotations

import re

from pydantic import model_validator

from m2po_cli.config.tables import Table, field

BUILTIN_ENVS = ("builtin:retry", "builtin:calculator")


class EnvConfig(Table):
    name: str = field(
        "",
        "The environment of an episode. Empty: one prompt, one answer. builtin:retry: the answer is "
        "graded and a wrong one is told to try again, up to max_turns attempts (reward 1 once right). "
        "builtin:calculator: a calculator tool (Hermes <tool_call> format), the answer scored by "
        "[reward]. Or a class `package.module:Name` (docs/environments.md): reset(row) may return the "
        "first messages; its typed public methods are tools, or step(text) returns the next messages "
        "(None ends the episode); an optional reward() scores the episode instead of [reward].",
    )
    max_turns: int = field(4, "Model turns per episode at most.", ge=1, le=256)
    max_tokens: int = field(
        0,
        "Response tokens per episode at most, the model's and the environment's together (each model "
        "turn also stops at rollout.max_new_tokens); 0: rollout.max_new_tokens x max_turns.",
        ge=0,
    )
    tool_timeout_s: float = field(
        10.0,
        "Seconds one tool call or step may take; past it the tool answers with the time-out as its error.",
        gt=0,
    )

    @model_validator(mode="after")
    def _check_name(self) -> EnvConfig:
        n = self.name
        if n.startswith("builtin:") and n not in BUILTIN_ENVS:
            raise ValueError(f"name: unknown builtin {n!r}; choose one of {', '.join(BUILTIN_ENVS)}")
        if n and not n.startswith("builtin:") and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", n):
            raise ValueError(f"name: {n!r} is neither a builtin nor `package.module:Name`")
        return self

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The most response tokens an episode holds: one turn without an environment."""
        if not self.name:
            return max_new_tokens
        return self.max_tokens or max_new_tokens * self.max_turns
