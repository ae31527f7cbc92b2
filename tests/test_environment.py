"""Environments (`[env] name`): a class that cannot serve stops the run in one line before anything
heavy; tools answer with their result, or with their error, counted; the builtins."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from m2po_cli.builtin_envs import RETRY_MESSAGE
from m2po_cli.environment import EnvError, EnvSession, load_environment
from tests.conftest import QUICKSTART


def call(name: str, arguments: dict) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("tests.nowhere:Env", "cannot load it: ModuleNotFoundError: No module named 'tests.nowhere'"),
        ("tests.envs:Missing", "cannot load it: AttributeError"),
        ("tests.envs:not_a_class", "is a int, not a class"),
        (
            "tests.envs:NoDocstring",
            "tool tool: Cannot generate JSON schema for tool because it has no docstring",
        ),
        ("tests.envs:BothKinds", "has both step() and tools"),
        ("tests.envs:NeedsArguments", "__init__(self, config) must take no arguments"),
        ("tests.envs:ResetTakesNothing", "reset(self) must take 1 argument (the dataset row)"),
    ],
)
def test_a_class_that_cannot_serve_is_refused_in_one_line(name, says):
    with pytest.raises(EnvError) as e:
        load_environment(name)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"env.name: {name!r}")


def test_the_cli_refuses_a_broken_environment_before_the_model_loads(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "m2po_cli",
            "train",
            str(QUICKSTART),
            "--set",
            'env.name="tests.envs:BothKinds"',
            "--set",
            f'run.output_dir="{tmp_path}"',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("has both step() and tools; an environment answers with one or the other")
    )
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()
    assert time.perf_counter() - start < 60


def test_tools_answer_with_their_result_or_their_error_and_failures_are_counted():
    env = load_environment("tests.envs:Tools")
    assert sorted(env.tools) == ["add", "slow"]
    assert env.tools["add"]["function"]["parameters"]["required"] == ["a", "b"]
    session = EnvSession(env, timeout_s=0.5)
    session.reset({"problem": "p", "answer": "a"})
    assert session.respond("no call: the final answer") is None
    turn = "".join(
        [
            call("add", {"a": 2, "b": 3}),
            call("add", {"a": 2}),  # a missing argument
            call("mul", {"a": 2, "b": 3}),  # no such tool
            "<tool_call>{not json</tool_call>",
            call("slow", {"seconds": -1}),  # raises
            call("slow", {"seconds": 5}),  # past the time-out
        ]
    )
    t0 = time.perf_counter()
    replies = session.respond(turn)
    assert time.perf_counter() - t0 < 3
    assert [r["role"] for r in replies] == ["tool"] * 6
    contents = [r["content"] for r in replies]
    assert contents[0] == "5"
    assert contents[1] == "error: TypeError: missing a required argument: 'b'"
    assert contents[2].startswith("error: ValueError: unknown tool 'mul'")
    assert contents[3].startswith("error: JSONDecodeError")
    assert contents[4] == "error: ValueError: negative time"
    assert contents[5] == "error: TimeoutError: no answer within 0.5 s (env.tool_timeout_s)"
    assert (session.tool_calls, session.tool_failures) == (6, 5)


def test_a_step_environment_its_opening_and_its_reward():
    session = EnvSession(load_environment("tests.envs:Echo"), timeout_s=1)
    assert session.reset({"problem": "2+2", "answer": "4"}) == [
        {"role": "user", "content": "Problem 2+2: reverse what you say."}
    ]
    assert session.respond("abc") == [{"role": "user", "content": "cba"}]
    assert session.reward() == 1.0


def test_retry_asks_again_until_right():
    session = EnvSession(load_environment("builtin:retry"), timeout_s=5)
    session.reset({"problem": "2+2", "answer": "4"})
    assert session.respond("\\boxed{5}") == [{"role": "user", "content": RETRY_MESSAGE}]
    assert session.reward() == 0.0
    assert session.respond("so \\boxed{4}") is None
    assert session.reward() == 1.0


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123456789*987654321", "121932631112635269"),
        ("(12+30)*7/4", "73.5"),
        ("-3+10//4", "-1"),
        ("7%3", "1"),
    ],
)
def test_the_calculator_is_exact(expression, value):
    session = EnvSession(load_environment("builtin:calculator"), timeout_s=1)
    session.reset({})
    assert session.respond(call("calculator", {"expression": expression})) == [
        {"role": "tool", "content": value}
    ]


def test_the_calculator_refuses_what_is_not_arithmetic():
    session = EnvSession(load_environment("builtin:calculator"), timeout_s=1)
    session.reset({})
    for expression in ["__import__('os')", "2**10000", "9" * 70 + "+1"]:
        (reply,) = session.respond(call("calculator", {"expression": expression}))
        assert reply["content"].startswith("error: "), reply
    assert session.tool_failures == 3
