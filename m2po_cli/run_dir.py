"""A run directory: what `m2po train` writes (`train/runlog.py`, `checkpoint.py`, `record.py`) and
`m2po compare`, `m2po inspect` and `m2po eval` read, without torch:

    config.toml        the fully resolved recipe
    meta.json          versions, git revision, command line, world size and nodes of every start
    metrics.jsonl      one JSON object per step
    samples.jsonl      sampled rows as text (`logging.samples`)
    third-party.log    the logs and warnings of vLLM, torch and transformers
    inspect/           per-token records (`record.py`)
    checkpoints/       DCP checkpoints with the loop state (`checkpoint.py`)
    export/            the final policy, HF safetensors

Metric keys that one module writes and another reads are named here once.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2po_cli.config import ConfigError, Recipe, load_recipe
from m2po_cli.errors import UserError

CONFIG, META, METRICS, SAMPLES = "config.toml", "meta.json", "metrics.jsonl", "samples.jsonl"
THIRD_PARTY, CHECKPOINTS, EXPORT = "third-party.log", "checkpoints", "export"
ADAPTER = "adapter"  # a LoRA run's final adapter, PEFT format
ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter's folder

REWARD = "rollout/reward_mean"  # the mean reward of the rows a step trained
BEHAVIOUR_VERSION = "staleness/behaviour_version"  # the oldest policy version that sampled them
# Colocated runs: the mean reward of the batch each step generates (trained s updates later), and
# the policy version that generated it.
NEWEST_REWARD, NEWEST_VERSION = "rollout/newest_reward_mean", "staleness/newest_version"
GENERATED_TOKENS = "rollout/generated_tokens"  # the tokens the engines sampled in the step
STEP_SECONDS = "time/step"  # the step's wall time
VERSION = "optim/version"  # the policy version after the step's updates
CLIP_FRAC = "loss/clip_frac"  # the share of trained tokens the loss clipped or masked
ABS_LOG_RATIO = "loss/abs_log_ratio_mean"  # the mean |log r| of the trained tokens


class RunDirError(UserError):
    """A folder that is not a readable run directory; one line naming the file and the fault."""


def is_run_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def require(path: Path) -> Path:
    """`path`, if it is a run directory; raises RunDirError otherwise."""
    if not is_run_dir(path):
        raise RunDirError(f"{path}: not a run directory (no {CONFIG}; `m2po train` writes one)")
    return Path(path)


def newest(runs: Path) -> Path:
    """The run directory under `runs` that changed last (its metrics, else its recipe)."""
    candidates = [p for p in runs.glob("*") if is_run_dir(p)] if runs.is_dir() else []
    if not candidates:
        raise RunDirError(f"no run directories under {runs}/")

    def last_change(run: Path) -> float:
        metrics = run / METRICS
        return (metrics if metrics.exists() else run / CONFIG).stat().st_mtime

    return max(candidates, key=last_change)


def read_recipe(run: Path) -> Recipe:
    """The run's recipe, validated as a recipe is, except that the model's folder and the data file
    it names are not looked for (the run may be read on another machine). Raises RunDirError."""
    path = require(run) / CONFIG
    try:
        return load_recipe(path, files=False)
    except ConfigError as e:
        what = f"{e.key}: {e.message}" if e.key else e.message
        raise RunDirError(f"{path}: not a valid run config ({what})") from None


def read_metrics(run: Path) -> list[dict]:
    """Every step's metrics, in order. Raises RunDirError for no steps, a line cut short by a kill,
    or a line that is not a step's metrics."""
    path = require(run) / METRICS
    text = path.read_text() if path.is_file() else ""
    if not text.strip():
        raise RunDirError(f"{path}: no steps logged")
    if not text.endswith("\n"):
        raise RunDirError(f"{path}: its last line is cut short (a killed run; resume it to repair)")
    steps = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            raise RunDirError(f"{path}: line {number} is not JSON") from None
        if not isinstance(step, dict) or "step" not in step or REWARD not in step:
            raise RunDirError(f"{path}: line {number} is not a step's metrics")
        steps.append(step)
    return steps
