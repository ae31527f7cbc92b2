"""DCP checkpoints of a run: sharded model and optimizer, plus the loop state.

`<run>/checkpoints/step-NNNNNN/` holds the DCP shards of model and optimizer (every rank writes its
own), the files the rollout source writes per rank (colocated: its rows of the staleness FIFO,
`queue-RRRRR-of-WWWWW.safetensors`), and `loop.pt` (rank 0, tensors and plain values, read with
`weights_only=True`): the step, the rollout mode, the learner's version and LR schedule, the data
position, what the source carries (separate: the prompts in flight) and the RNG state. Then rank 0
writes `MANIFEST.json` (every file of the folder with its size), syncs the files and the folder to
disk, and writes `COMPLETE` last.

A step counts only if it verifies (`verify`): `COMPLETE` is there, every file of the manifest has its
size, every file DCP's `.metadata` names holds the bytes it points at, and the loop state loads.
Resume takes the newest step that verifies and says which newer ones it skipped, so a damaged
checkpoint costs the steps since the one before it, never the run. HF exports live outside
`checkpoints/`. torch is imported inside the functions that need it: `m2po eval` lists steps without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from m2po_cli.run_dir import CHECKPOINTS

STEP_PREFIX = "step-"
DONE = "COMPLETE"
MANIFEST = "MANIFEST.json"
LOOP = "loop.pt"
# The loop state's format: 2 names the rollout mode (`mode`); 1 did not, and told it by whether it
# carried prompts in flight (separate mode did). `read_loop` reads both as 2.
FORMAT = 2


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:06d}"


def complete_steps(run_dir: Path) -> list[Path]:
    """The run's step folders that pass `check_files`, oldest first."""
    root = run_dir / CHECKPOINTS
    steps = sorted(root.glob(f"{STEP_PREFIX}*")) if root.is_dir() else []
    return [p for p in steps if check_files(p) is None]


def check_files(path: Path) -> str | None:
    """Why the step folder is not complete on disk (no torch needed), or None when it is."""
    if not (path / DONE).is_file():
        return f"no {DONE} file (killed while saving?)"
    manifest = path / MANIFEST
    if not manifest.is_file():  # written by every save before COMPLETE
        return f"{MANIFEST} is missing"
    try:
        sizes = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return f"{MANIFEST} is corrupt"
    for name, size in sizes.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def verify(path: Path) -> str | None:
    """Why the step cannot be resumed from, or None when it can (see the module docstring)."""
    problem = check_files(path)
    if problem is not None:
        return problem
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or garbled pickle raises whatever it raises
        return f".metadata does not load ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size < size:
            return f"{name} has {f.stat().st_size} bytes, .metadata needs {size}"
    try:
        read_loop(path)
    except Exception as e:
        return f"{LOOP} does not load ({type(e).__name__})"
    return None


def choose(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest step that verifies, and the newer ones skipped with why; a collective.

    Rank 0 decides and the others take its answer, so every rank loads the same step.
    """
    import torch.distributed as dist

    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        root = run_dir / CHECKPOINTS
        skipped = []
        for path in sorted(root.glob(f"{STEP_PREFIX}*"), reverse=True) if root.is_dir() else []:
            problem = verify(path)
            if problem is None:
                answer = [(path, skipped)]
                break
            if (path / DONE).exists():  # a folder without COMPLETE is a save cut short: no news
                skipped.append((path, problem))
        else:
            answer = [(None, skipped)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


class Restored(NamedTuple):
    """The checkpoint a run resumed from: its folder and the loop state saved in it."""

    path: Path
    loop: dict


def save(
    run_dir: Path,
    step: int,
    learner,
    loop_state: dict,
    keep: int,
    rank_files: Callable[[Path], object] | None = None,
) -> Path:
    """Save after `step` steps are done; a collective. Keeps the newest `keep` checkpoints.

    `rank_files(folder)`, if given, writes this rank's own files (the staleness FIFO) into the folder.
    A SIGTERM or Ctrl-C that arrives meanwhile takes effect once the save is sealed (`signals_held`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with signals_held():
        path = step_dir(run_dir, step)
        path.mkdir(parents=True, exist_ok=True)
        # Before dcp.save, which returns on rank 0 only once every rank's writes are done: the queue
        # shards are on disk before rank 0 lists the folder into the manifest.
        if rank_files is not None:
            rank_files(path)
        dcp.save(learner.state_dict(), checkpoint_id=str(path))  # returns once every rank's shard is written
        if dist.get_rank() == 0:
            state = {
                **loop_state,
                "format": FORMAT,
                "learner": learner.extra_state(),
                "rng": torch.get_rng_state(),
            }
            torch.save(state, path / LOOP)
            _seal(path, step)
            done = complete_steps(path.parent.parent)
            for old in done[:-keep]:
                shutil.rmtree(old)
        dist.barrier()
        return path


@contextlib.contextmanager
def signals_held(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block is done, then deliver them to the handlers they had.

    A handler that raises (the run's SIGTERM handler, Ctrl-C's KeyboardInterrupt) inside a DCP save
    would surface as DCP's CheckpointException, exit 1, and leave the step unsealed on some ranks;
    held, every rank finishes the collective save and then stops as asked. Only the main thread can
    set handlers; elsewhere this does nothing. If the block raises, the signals it held are dropped:
    the run stops with its error."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: arrived.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    for s in dict.fromkeys(arrived):
        signal.raise_signal(s)


def _seal(path: Path, step: int) -> None:
    """Manifest, fsync of every file and of the folder, then COMPLETE (itself synced)."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name not in (MANIFEST, DONE))
    for f in files:
        _fsync(f)
    _write_synced(path / MANIFEST, json.dumps({f.name: f.stat().st_size for f in files}, indent=1) + "\n")
    _fsync(path)
    _write_synced(path / DONE, f"{step}\n")
    _fsync(path)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_loop(path: Path) -> dict:
    """The loop state saved beside the shards, in `FORMAT`."""
    import torch

    loop = torch.load(path / LOOP, weights_only=True)
    if loop.get("format", 1) == 1:
        loop = {**loop, "format": FORMAT, "mode": "separate" if "in_flight" in loop else "colocated"}
    return loop


def load(path: Path, learner) -> dict:
    """Restore the learner in place; return the loop state saved beside it."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = learner.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    learner.load_state_dict(state)
    loop = read_loop(path)
    learner.load_extra_state(loop["learner"])
    torch.set_rng_state(loop["rng"])
    return loop


def read_model(path: Path) -> dict:
    """The model weights of a saved step as plain full tensors (torchtitan names), in this process.

    Reads only the model's entries (not the optimizer state) into tensors allocated from `.metadata`:
    no learner, no process group, and one copy of the weights in memory.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return model
