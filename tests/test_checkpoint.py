"""Checkpoints on the real learner: every save is sealed, and a damaged newest step never blocks a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from m2po_cli import checkpoint
from m2po_cli.cli import main
from m2po_cli.data import PromptBatches, load_problems
from m2po_cli.errors import RunError
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.train.fifo import StalenessQueue
from m2po_cli.train.loop import resume
from m2po_cli.train.runlog import RunLog
from tests.conftest import recipe_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A learner on the tiny builtin, its recipe and prompt batches (no engine)."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("ckpt")
    base = resolve_model("builtin:tiny-qwen3")
    recipe = recipe_for(tmp, 'run.name="tiny"', f'model.path="{base}"', "checkpoint.keep=5")
    prompts = PromptBatches(
        load_problems(recipe.data), AutoTokenizer.from_pretrained(str(base)), recipe.data, 32
    )
    return Learner(base, recipe), recipe, prompts


def _save_steps(run: Path, learner: Learner, prompts: PromptBatches, steps: list[int]) -> dict[int, dict]:
    """Save each step with distinct weights and data position; return each step's model weights."""
    weights = {}
    for step in steps:
        with torch.no_grad():
            for p in learner.model.parameters():
                p.to_local().add_(0.1)
        next(prompts)
        loop = {"step": step, "mode": "colocated", "data": prompts.state_dict()}
        checkpoint.save(
            run, step, learner, loop, keep=5, rank_files=lambda folder: StalenessQueue(0).save(folder, 0, 1)
        )
        weights[step] = {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}
    return weights


def test_a_save_is_sealed_by_a_manifest_of_every_file(tiny, tmp_path):
    learner, _, prompts = tiny
    _save_steps(tmp_path, learner, prompts, [1])
    step = checkpoint.step_dir(tmp_path, 1)
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    on_disk = {p.name for p in step.iterdir()} - {checkpoint.MANIFEST, checkpoint.DONE}
    assert set(manifest) == on_disk and {".metadata", "loop.pt", "__0_0.distcp"} <= on_disk
    assert all((step / name).stat().st_size == size for name, size in manifest.items())
    assert checkpoint.verify(step) is None


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "shard missing": (lambda s: (s / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "loop state missing": (lambda s: (s / "loop.pt").unlink(), "loop.pt is missing"),
    "metadata missing": (lambda s: (s / ".metadata").unlink(), ".metadata is missing"),
    "shard truncated": (lambda s: _truncate(s / "__0_0.distcp"), "__0_0.distcp has"),
    "no manifest": (lambda s: (s / checkpoint.MANIFEST).unlink(), "MANIFEST.json is missing"),
    "queue shard missing": (
        lambda s: (s / "queue-00000-of-00001.safetensors").unlink(),
        "queue-00000-of-00001.safetensors is missing",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_newest_step(tiny, tmp_path, capsys, kind):
    learner, recipe, prompts = tiny
    run = tmp_path / "tiny"
    weights = _save_steps(run, learner, prompts, [2, 4])
    position_at_2 = torch.load(checkpoint.step_dir(run, 2) / "loop.pt", weights_only=True)["data"]
    damage, reason = DAMAGE[kind]
    damage(checkpoint.step_dir(run, 4))
    assert reason in checkpoint.verify(checkpoint.step_dir(run, 4))

    log = RunLog(run, recipe, 1)
    done, restored = resume(run, recipe, learner, prompts, log)
    assert done == 2 and restored.path == checkpoint.step_dir(run, 2)
    assert prompts.state_dict() == position_at_2
    now = {k: v.full_tensor() for k, v in learner.model.state_dict().items()}
    assert all(torch.equal(now[k], weights[2][k]) for k in now)
    skipped, resumed = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "step-000004" in skipped and reason in skipped
    assert resumed.endswith("resumed at step 2, policy version 0")


def test_a_step_without_complete_is_ignored_quietly(tiny, tmp_path, capsys):
    learner, recipe, prompts = tiny
    run = tmp_path / "tiny"
    _save_steps(run, learner, prompts, [2, 4])
    (checkpoint.step_dir(run, 4) / checkpoint.DONE).unlink()  # killed while saving
    assert resume(run, recipe, learner, prompts, RunLog(run, recipe, 1))[0] == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]  # nothing on step 4
    assert line.endswith("resumed at step 2, policy version 0")


@pytest.mark.parametrize("saved", ["separate", "legacy separate"])
def test_a_checkpoint_of_the_other_mode_is_refused_before_anything_loads(tiny, tmp_path, saved, monkeypatch):
    """The mode is recorded in `loop.pt`; a checkpoint of format 1, from before that record, tells it
    by its prompts in flight. Resuming it in the other mode stops in one line naming both, weights
    untouched."""
    learner, recipe, prompts = tiny
    run = tmp_path / "tiny"
    loop = {"step": 2, "data": prompts.state_dict(), "in_flight": [], "fresh": []}
    if saved == "separate":
        loop["mode"] = "separate"
    else:
        monkeypatch.setattr(checkpoint, "FORMAT", 1)
    checkpoint.save(run, 2, learner, loop, keep=5)
    monkeypatch.undo()
    before = {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}
    with torch.no_grad():
        for p in learner.model.parameters():
            p.to_local().add_(0.1)
    moved = {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}
    with pytest.raises(RunError) as caught:
        resume(run, recipe, learner, prompts, None)
    message = str(caught.value)
    assert "\n" not in message and str(checkpoint.step_dir(run, 2)) in message
    assert "separate-mode run" in message and "rollout.mode = separate" in message
    now = {k: v.full_tensor() for k, v in learner.model.state_dict().items()}
    assert all(torch.equal(now[k], moved[k]) for k in now), "resume loaded the other mode's weights"
    assert not all(torch.equal(now[k], before[k]) for k in now)


def test_eval_rejects_a_damaged_step_in_one_line(tiny, tmp_path):
    learner, recipe, prompts = tiny
    run = tmp_path / "tiny"
    _save_steps(run, learner, prompts, [2])
    (run / "config.toml").write_text("")  # marks a run directory
    (checkpoint.step_dir(run, 2) / "loop.pt").unlink()
    result = CliRunner().invoke(main, ["eval", str(checkpoint.step_dir(run, 2))])
    assert result.exit_code == 2
    assert (
        result.output.strip() == f"{checkpoint.step_dir(run, 2)}: incomplete checkpoint: loop.pt is missing"
    )


def test_a_one_process_group_leaves_nothing_in_tmpdir(tmp_path):
    code = "from m2po_cli.distributed import init_distributed; init_distributed()"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_fall_every_k_steps_and_after_the_last_only_if_asked(tmp_path):
    from m2po_cli.train.loop import checkpoint_due

    def due(*overrides):
        recipe = recipe_for(tmp_path, "run.steps=10", *overrides)
        return [step for step in range(10) if checkpoint_due(recipe, step)]

    assert due("checkpoint.every=4") == [3, 7]
    assert due("checkpoint.every=5") == [4, 9]
    assert due("checkpoint.every=0") == []
    assert due("checkpoint.every=4", "checkpoint.final=true") == [3, 7, 9]
    assert due("checkpoint.every=0", "checkpoint.final=true") == [9]


def test_a_sigterm_during_a_save_stops_the_run_after_the_save_is_sealed(tiny, tmp_path):
    """The run's SIGTERM handler raises SystemExit; raised inside the save, it would leave the step
    unsealed (inside DCP's collectives it surfaces as a CheckpointException and exit 1)."""
    import signal

    from m2po_cli.cli import _exit_on_sigterm

    learner, _, prompts = tiny
    previous = signal.getsignal(signal.SIGTERM)
    _exit_on_sigterm()
    try:

        def queue_then_sigterm(folder: Path) -> None:
            StalenessQueue(0).save(folder, 0, 1)
            signal.raise_signal(signal.SIGTERM)

        loop = {"step": 7, "mode": "colocated", "data": prompts.state_dict()}
        with pytest.raises(SystemExit) as stopped:
            checkpoint.save(tmp_path, 7, learner, loop, keep=5, rank_files=queue_then_sigterm)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert checkpoint.verify(checkpoint.step_dir(tmp_path, 7)) is None
    assert signal.getsignal(signal.SIGTERM) is previous
