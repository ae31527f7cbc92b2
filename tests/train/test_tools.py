"""The tools quickstart (`recipes/tools-quickstart.toml`): the tiny calculator model in two-turn
episodes with `builtin:calculator`, end to end in both rollout modes. The model calls the tool, the
tool answers, the answers are scored; the tool's tokens ride as context and never count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def train(tmp_path: Path, *sets: str) -> list[dict]:
    args = [sys.executable, "-m", "m2po_cli", "train", "recipes/tools-quickstart.toml"]
    for s in (f'run.output_dir="{tmp_path}"', 'logging.console="plain"', *sets):
        args += ["--set", s]
    done = subprocess.run(args, cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert not any("Warning" in line for line in lines), "\n".join(lines)  # third-party noise: in its log
    return [json.loads(line) for line in (tmp_path / "tools-quickstart" / "metrics.jsonl").open()]


@pytest.mark.parametrize("mode", ["colocated", "separate"])
def test_the_tools_quickstart_calls_the_calculator_in_both_modes(tmp_path, mode):
    sets = ["run.steps=3", "rollout.prompts_per_step=8", "logging.samples=2", "logging.samples_every=1"]
    if mode == "separate":
        sets += ['rollout.mode="separate"', "staleness.max_staleness=2"]
    steps = train(tmp_path, *sets)
    for m in steps:
        assert m["env/tool_calls_mean"] > 0.2 and m["env/turns_mean"] > 1.2  # it calls the tool
        # Between two turns: "\n<|im_start|>tool\n", the sum (1-4 digits; an error is longer) and
        # "<|im_end|>\n<|im_start|>assistant\n": 20 tokens of template around each answer.
        per_answer = m["env/env_tokens_mean"] / (m["env/turns_mean"] - 1)
        assert 21 <= per_answer and (per_answer <= 24 or m["env/tool_failures_mean"] > 0)
        assert m["loss/num_tokens"] == pytest.approx(m["env/model_tokens_mean"] * 64)  # only the model's
        assert 0 < m["rollout/reward_mean"] < 1
    samples = [json.loads(line) for line in (tmp_path / "tools-quickstart" / "samples.jsonl").open()]
    called = [s for s in samples if "<tool_call>" in s["completion"]]
    assert called and all("\ntool\n" in s["completion"] for s in called), samples  # whole episodes
