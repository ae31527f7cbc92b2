"""The one reader of a run directory: its recipe reads where the model and the data it names are not
(another machine, a moved file), and what is not a run directory, or not a whole one, is named in one
line."""

from __future__ import annotations

import json
import os

import pytest

from m2po_cli import run_dir
from m2po_cli.config import ConfigError, load_recipe
from m2po_cli.config.tables import to_toml
from m2po_cli.run_dir import RunDirError, read_metrics, read_recipe
from tests.conftest import QUICKSTART


def run_with(tmp_path, *overrides: str):
    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    recipe = load_recipe(QUICKSTART, [f'data.source="{data}"', f'model.path="{model}"', *overrides])
    run = tmp_path / "run"
    run.mkdir()
    (run / run_dir.CONFIG).write_text(to_toml(recipe))
    return run, data, model, recipe


def test_a_runs_recipe_reads_where_its_model_and_data_are_gone(tmp_path):
    run, data, model, recipe = run_with(tmp_path, "staleness.s=8")
    data.unlink()
    model.rmdir()
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(run / run_dir.CONFIG)  # as a recipe to train, it no longer is one
    assert read_recipe(run) == recipe


def test_what_is_not_a_run_directory_is_named(tmp_path):
    with pytest.raises(RunDirError, match=f"^{tmp_path}: not a run directory"):
        read_recipe(tmp_path)
    run, *_ = run_with(tmp_path)
    config = run / run_dir.CONFIG
    config.write_text(config.read_text().replace("tau = 0.04", "tau = -1"))
    with pytest.raises(RunDirError, match=r"config.toml: not a valid run config \(loss.tau: must be > 0"):
        read_recipe(run)


@pytest.mark.parametrize(
    "text, fault",
    [("", "no steps logged"), ('{"step": 0, "rollout/reward_mean": 0.5}', "cut short"),
     ('{"step": 0}\n', "line 1 is not a step's metrics"), ("{\n", "line 1 is not JSON")],
)  # fmt: skip
def test_metrics_that_are_not_whole_are_named(tmp_path, text, fault):
    run, *_ = run_with(tmp_path)
    (run / run_dir.METRICS).write_text(text)
    with pytest.raises(RunDirError, match=fault):
        read_metrics(run)


def test_the_newest_run_is_the_one_whose_metrics_changed_last(tmp_path):
    runs = tmp_path / "runs"
    for name, when in [("a", 200), ("b", 100)]:
        (runs / name).mkdir(parents=True)
        (runs / name / run_dir.CONFIG).write_text("")
        (runs / name / run_dir.METRICS).write_text("")
        os.utime(runs / name / run_dir.METRICS, (when, when))
    assert run_dir.newest(runs) == runs / "a"
    with pytest.raises(RunDirError, match="no run directories under"):
        run_dir.newest(tmp_path / "empty")
