"""DCP checkpoints of a run: sharded model and optimizer, plus the loop state.

`<run>/checkpoints/step-NNNNNN/` holds the DCP shards of model and optimizer (every rank writes its
own), and `loop.pt` (rank 0): the step, the learner's version and LR schedule, the staleness FIFO,
the data position and the RNG states. A `COMPLETE` file is written last; a folder without it (a run
killed mid-save) is ignored on resume. HF exports live outside `checkpoints/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

STEP_PREFIX = "step-"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{STEP_PREFIX}{step:06d}"


def latest(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    done = (
        sorted(p for p in root.glob(f"{STEP_PREFIX}*") if (p / "COMPLETE").exists()) if root.exists() else []
    )
    return done[-1] if done else None


def save(run_dir: Path, step: int, learner, loop_state: dict, keep: int) -> Path:
    """Save after `step` steps are done; a collective. Keeps the newest `keep` checkpoints."""
    path = step_dir(run_dir, step)
    dcp.save(learner.state_dict(), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        state = {**loop_state, "learner": learner.extra_state(), "rng": torch.get_rng_state()}
        torch.save(state, path / "loop.pt")
        (path / "COMPLETE").write_text(f"{step}\n")
        done = sorted(p for p in path.parent.glob(f"{STEP_PREFIX}*") if (p / "COMPLETE").exists())
        for old in done[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return path


def load(path: Path, learner) -> dict:
    """Restore the learner in place; return the loop state saved beside it."""
    state = learner.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    learner.load_state_dict(state)
    loop = torch.load(path / "loop.pt", weights_only=False)
    learner.load_extra_state(loop["learner"])
    torch.set_rng_state(loop["rng"])
    return loop


def load_model(path: Path, learner) -> None:
    """Restore only the learner's model weights from a saved step (no optimizer state, no loop state)."""
    state = {"model": get_model_state_dict(learner.model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(learner.model, state["model"])
