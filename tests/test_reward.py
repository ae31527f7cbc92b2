"""`reward.function`: a recipe's own reward, run a group at a time in the grader's worker pool with
its time limit; anything but one finite number per completion stops the run in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2po_cli.config import load_recipe
from m2po_cli.config.tables import ConfigError
from m2po_cli.data import Problem, load_problems
from m2po_cli.grader import Grader, RewardError, load_reward
from tests.conftest import QUICKSTART, recipe_for

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = [Problem(0, "2+5", "7", {"weight": 0.5}), Problem(1, "1+1", "2", {"weight": 2})]
GROUPS = [["so 7", "2+5 is 7", "8"], ["2", "it is 2!", "two"]]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_function_scores_every_response_with_the_rows_fields(workers):
    with Grader(num_workers=workers, reward="tests.rewards:weighted_match") as grader:
        assert grader.score_groups(PROBLEMS, GROUPS) == [[0.5, -1.0, 0.0], [2.0, 2.0, 0.0]]
    with Grader(num_workers=workers, reward="tests.rewards:length") as grader:
        assert grader.score_groups(PROBLEMS, GROUPS) == [[4.0, 8.0, 1.0], [1.0, 8.0, 3.0]]


def test_without_a_function_the_math_grader_scores_the_groups():
    with Grader(num_workers=0) as grader:
        groups = [["\\boxed{7}", "\\boxed{8}"], ["no box", "$\\boxed{2}$"]]
        assert grader.score_groups(PROBLEMS, groups) == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.parametrize(
    "name, fault",
    [
        ("raises", "raised KeyError: 'no such column"),
        ("too_few", "returned 2 values for 3 completions"),
        ("not_numbers", "returned '1.0', not a finite number"),
        ("infinite", "returned inf, not a finite number"),
    ],
)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_function_that_fails_stops_the_run_in_one_line(name, fault, workers):
    with Grader(num_workers=workers, reward=f"tests.rewards:{name}") as grader:
        with pytest.raises(RewardError) as err:
            grader.score_groups(PROBLEMS, GROUPS)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward.function tests.rewards:{name}: {fault}")
    assert "(problem 0: '2+5')" in message


def test_a_group_past_the_time_limit_scores_zero_and_the_pool_goes_on():
    with Grader(num_workers=1, timeout_s=0.5, reward="tests.rewards:slow_on_seven") as grader:
        assert grader.score_groups(PROBLEMS, GROUPS) == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
        assert grader.num_timeouts == 1
        assert grader.score_groups(PROBLEMS[1:], GROUPS[1:]) == [[1.0, 1.0, 1.0]]


@pytest.mark.parametrize(
    "spec, fault",
    [
        ("tests.no_such_module:f", "cannot load 'tests.no_such_module:f': ModuleNotFoundError"),
        ("tests.rewards:nothing", "cannot load 'tests.rewards:nothing': AttributeError"),
        ("tests.rewards:NOT_CALLABLE", "'tests.rewards:NOT_CALLABLE' is a int, not a callable"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_named(spec, fault):
    with pytest.raises(RewardError, match="^reward.function: " + fault):
        load_reward(spec)


def test_a_malformed_name_is_a_recipe_error():
    with pytest.raises(ConfigError, match=r"reward.function: 'tests.rewards' is not `package.module:name`"):
        load_recipe(QUICKSTART, ['reward.function="tests.rewards"'])


def test_the_rows_other_fields_are_kept_only_for_a_function(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"problem": "1+1", "answer": 2, "weight": 3, "tags": ["a"]}) + "\n")
    data = recipe_for(tmp_path, f'data.source="{path}"').data
    (kept,) = load_problems(data, columns=True)
    assert kept.columns == {"weight": 3, "tags": ["a"]} and kept.answer == "2"
    (plain,) = load_problems(data)
    assert plain.columns == {}


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`m2po train` of the quickstart, two steps, nothing saved, as a whole process."""
    sets = [f'run.output_dir="{tmp_path}"', "run.steps=2", "inspect.every=0",
            "checkpoint.export_hf=false", 'logging.console="plain"', *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "m2po_cli", "train", str(QUICKSTART), *[a for o in sets for a in ("--set", o)]],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip


def test_train_refuses_an_unloadable_function_before_anything_starts(tmp_path):
    done = train(tmp_path, 'reward.function="tests.rewards:nothing"')
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "reward.function: cannot load 'tests.rewards:nothing': AttributeError: "
            "module 'tests.rewards' has no attribute 'nothing'"
        )
    )
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_run_trains_on_the_functions_rewards(tmp_path):
    """Two colocated steps of the quickstart with each response's length as its reward: every logged
    sample's reward is the length of its completion, and the step's mean reward is theirs."""
    rows = 32 * 8
    done = train(
        tmp_path,
        'reward.function="tests.rewards:length"',
        f"logging.samples={rows}",
        "logging.samples_every=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "quickstart"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and len(samples) == 2 * rows
    assert all(s["reward"] == len(s["completion"]) for s in samples)
    assert any(s["reward"] > 1 for s in samples)  # not the math grader's 0 or 1
    assert "scored 0" not in done.stderr
    for step in steps:
        mine = [s["reward"] for s in samples if s["step"] == step["step"]]
        assert step["rollout/reward_mean"] == pytest.approx(sum(mine) / len(mine), rel=1e-6)


@pytest.mark.slow
def test_a_run_whose_first_steps_score_nothing_says_so_once_with_a_sample(tmp_path):
    """A reward that reads a column the data does not have scores every sample 0: the console says
    so once, after the first steps, with what scores them and one sampled answer and its reward."""
    done = train(tmp_path, 'reward.function="tests.rewards:from_solution_column"', "run.steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "scored 0" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert said[0].startswith(
        "every sample of the first 2 steps scored 0 (reward.function tests.rewards:from_solution_column); "
        "one of them: prompt '"
    )
    assert "-> completion '" in said[0] and said[0].endswith(", reward 0")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, fault", [("raises", "raised KeyError"), ("too_few", "returned 7 values for 8 completions"),
                    ("not_numbers", "returned '1.0', not a finite number")],
)  # fmt: skip
def test_a_run_with_a_failing_function_exits_2_in_one_line(tmp_path, name, fault):
    done = train(tmp_path, f'reward.function="tests.rewards:{name}"')
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"reward.function tests.rewards:{name}: {fault}" in last and "(problem " in last
    assert "Traceback" not in done.stderr
