"""Environments: what answers a model's turn in a multi-turn episode (`[env]`).

An environment is a class with a no-argument constructor; one instance serves one episode. Its shape
follows TRL's `environment_factory`, so users can bring theirs:

- `reset(row)` starts the episode on a dataset row (`problem`, `answer` and the record's other
  fields); it may return the first messages (a string is one user message), which join the prompt.
- Tools: its public methods with type hints and a docstring (`Args:` section) are the tools; their
  JSON schemas go to the chat template, the model calls them in the Hermes format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen's and many others'), and each
  result comes back as a `tool` message. A turn without a call ends the episode.
- Or `step(text)`: the model's turn as text in, the next messages out (a string is one user message);
  None ends the episode.
- `reward()` (optional) scores the episode once it ends; without it `[reward]` grades the model's text.

A tool (or step) that raises, runs past `env.tool_timeout_s`, or is called with bad arguments or an
unknown name answers with its error as the message and counts as a failure; the episode goes on. A
class that cannot be used (missing, not importable, a wrong signature, a tool without a schema) stops
the run in one line before anything heavy starts (`load_environment`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m2po_cli.chat import Message
from m2po_cli.errors import UserError, first_line

RESERVED = ("reset", "step", "reward")  # methods of the protocol, never tools
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class EnvError(UserError):
    """`[env] name` cannot be used as an environment; the message says why and where."""


@dataclass(frozen=True)
class EnvironmentClass:
    """A checked environment class: its tools' schemas (empty for a `step` environment)."""

    name: str  # as the recipe names it
    cls: type
    tools: dict[str, dict]  # tool name -> JSON schema (`transformers.utils.get_json_schema`)
    scores: bool  # has reward()

    @property
    def schemas(self) -> list[dict]:
        return list(self.tools.values())


def load_environment(name: str) -> EnvironmentClass:
    """The class `[env] name` names (a builtin or `package.module:Name`), checked: cheap, before the
    model loads. Raises EnvError in one line."""
    from m2po_cli.builtin_envs import BUILTINS

    where = f"env.name: {name!r}"
    if name in BUILTINS:
        cls = BUILTINS[name]
    else:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as e:  # an import runs arbitrary code: any failure is the environment's
            raise EnvError(f"{where}: cannot load it: {type(e).__name__}: {first_line(e)}") from None
    if not inspect.isclass(cls):
        raise EnvError(f"{where} is a {type(cls).__name__}, not a class")
    _check_signature(cls, "__init__", 0, where)
    _check_signature(cls, "reset", 1, where)
    tools = _tool_schemas(cls, where)
    has_step = callable(getattr(cls, "step", None))
    if has_step:
        _check_signature(cls, "step", 1, where)
    if has_step == bool(tools):
        why = "both step() and tools" if has_step else "neither step(text) nor a public method (a tool)"
        raise EnvError(f"{where} has {why}; an environment answers with one or the other")
    scores = callable(getattr(cls, "reward", None))
    if scores:
        _check_signature(cls, "reward", 0, where)
    return EnvironmentClass(name, cls, tools, scores)


def _check_signature(cls: type, method: str, num_args: int, where: str) -> None:
    function = getattr(cls, method, None)
    if not callable(function):
        raise EnvError(f"{where} has no {method}() method")
    if method == "__init__" and function is object.__init__:
        return
    params = list(inspect.signature(function).parameters.values())[1:]  # after self
    required = [
        p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    takes_more = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > num_args or (len(positional) < num_args and not takes_more):
        shown = "no arguments" if not num_args else f"{num_args} argument"
        what = {"reset": " (the dataset row)", "step": " (the model's turn as text)"}.get(method, "")
        raise EnvError(f"{where}: {method}{inspect.signature(function)} must take {shown}{what}")


def _tool_schemas(cls: type, where: str) -> dict[str, dict]:
    from transformers.utils import get_json_schema

    tools = {}
    for name, function in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        try:
            schema = get_json_schema(function)
        except Exception as e:  # noqa: BLE001 (transformers raises several kinds for one cause)
            raise EnvError(f"{where}: tool {name}: {first_line(e)}") from None
        tools[name] = schema
    return tools


def as_messages(value: Any, role: str, where: str) -> list[Message] | None:
    """What reset() or step() returned, as messages: None, a string (one message of `role`), a message
    dict or a list of them. Anything else is an error of the environment."""
    if value is None:
        return None
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    items = [value] if isinstance(value, dict) else value
    if isinstance(items, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
        return [dict(m) for m in items]
    raise TypeError(
        f"{where} returned {type(value).__name__}; expected a string, a message or a list of them"
    )


def call_within(function: Callable[[], Any], timeout_s: float) -> Any:
    """`function()`, or TimeoutError after `timeout_s`. A Python call cannot be stopped from outside:
    one past its time keeps running in its (daemon) thread, and its result is dropped."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = function()
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            out["error"] = e

    thread = threading.Thread(target=run, name="env-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s (env.tool_timeout_s)")
    if "error" in out:
        raise out["error"]
    return out.get("value")


class EnvSession:
    """One episode's environment: an instance of the class, its replies to the model's turns, and
    its counters (tool calls, failed ones)."""

    def __init__(self, env: EnvironmentClass, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self.instance = env.cls()
        self.tool_calls = self.tool_failures = 0

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """Start on `row`; the first messages, which join the prompt (may be none)."""
        first = call_within(lambda: self.instance.reset(row), self.timeout_s)
        return as_messages(first, "user", f"{self.env.name} reset()") or []

    def respond(self, text: str) -> list[Message] | None:
        """The environment's answer to the model's turn `text`; None ends the episode."""
        if not self.env.tools:
            try:
                reply = call_within(lambda: self.instance.step(text), self.timeout_s)
                return as_messages(reply, "user", f"{self.env.name} step()")
            except Exception as e:  # noqa: BLE001 (the environment's failure is its message)
                self.tool_failures += 1
                return [{"role": "user", "content": f"error: {type(e).__name__}: {first_line(e)}"}]
        calls = TOOL_CALL.findall(text)
        if not calls:
            return None
        return [{"role": "tool", "content": self._call(body)} for body in calls]

    def _call(self, body: str) -> str:
        self.tool_calls += 1
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if name not in self.env.tools:
                raise ValueError(f"unknown tool {name!r}; tools: {', '.join(self.env.tools)}")
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be an object")
            method = getattr(self.instance, name)
            inspect.signature(method).bind(**arguments)  # a bad argument fails here, not inside
            return str(call_within(lambda: method(**arguments), self.timeout_s))
        except Exception as e:  # noqa: BLE001 (every failure is the tool's message)
            self.tool_failures += 1
            return f"error: {type(e).__name__}: {first_line(e)}"

    def reward(self) -> float | None:
        """The episode's score from reward(), or None when `[reward]` grades it."""
        if not self.env.scores:
            return None
        value = call_within(self.instance.reward, self.timeout_s)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{self.env.name} reward() returned {type(value).__name__}, not a number")
        return float(value)
