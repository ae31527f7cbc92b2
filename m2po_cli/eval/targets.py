"""What `m2po eval CKPT` evaluates: checkpoints named on the command line, resolved to model directories.

A CKPT is one of:
- an HF model directory (`config.json` and safetensors), evaluated as it is;
- a run directory (`config.toml` beside `export/` or `checkpoints/`): its final `export/`, or with
  `--all-checkpoints` each complete saved step;
- one saved step of a run (`<run>/checkpoints/step-NNNNNN`, DCP shards): converted once to an HF
  directory in `$M2PO_CACHE/exports/` (default ~/.cache/m2po), never inside the run; a LoRA run's
  step holds the adapter alone, merged into the base model by the conversion;
- a LoRA adapter in PEFT format (`adapter_config.json`; a LoRA run's `<run>/adapter`, which the run
  directory stands for when it has no merged `export/`): merged once into its base model there too;
- a hub id or a builtin model name (`builtin:tiny-qwen3`), resolved as a recipe's `model.path` is.

`resolve_targets` only looks at the file system, so a mistake fails in milliseconds; `model_dir()`
does the work (download, build or conversion). A target's `identity` hashes its path and the size
and modification time of its files: a retrained run or an overwritten export gets fresh results.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from m2po_cli import checkpoint, run_dir
from m2po_cli.errors import UserError
from m2po_cli.models import ModelError, check_model_dir, model_source
from m2po_cli.run_dir import ADAPTER_CONFIG


class TargetError(UserError):
    """A CKPT argument that names nothing evaluable (one line, naming the path)."""


@dataclass(frozen=True)
class Target:
    """One checkpoint to evaluate. `path` is the model directory, the step directory or the hub id."""

    label: str
    kind: Literal["model", "step", "adapter", "hub"]
    path: str

    def identity(self) -> str:
        """Stable while the checkpoint's files are unchanged; differs for any other checkpoint.

        For a hub id or builtin, the files are those it resolves to (a snapshot of one revision, a
        builtin built from one spec): resolving it first, so a new revision gets fresh results.
        """
        directory = self.model_dir() if self.kind == "hub" else Path(self.path)
        return stable_hash(_file_stats(directory))

    def model_dir(self) -> Path:
        """A local HF-format directory with these weights (converted, downloaded or built if needed),
        checked whole before anything loads it. Raises TargetError."""
        try:
            if self.kind == "model":
                directory = Path(self.path)
            elif self.kind in ("step", "adapter"):
                directory = export_step(Path(self.path))
            else:
                directory = _resolve_model(self.path)
            check_model_dir(directory)
        except ModelError as e:
            raise TargetError(str(e)) from None
        return directory


@functools.cache
def _resolve_model(name: str) -> Path:
    # Once per process: a hub id would otherwise ask the hub for its latest revision on every call.
    from m2po_cli.models import resolve_model

    return resolve_model(name)


def resolve_targets(args: list[str], all_checkpoints: bool) -> list[Target]:
    """Targets for the CKPT arguments, in order. Raises TargetError."""
    targets: list[Target] = []
    for arg in args:
        targets.extend(_resolve_one(arg, all_checkpoints))
    return targets


def _resolve_one(arg: str, all_checkpoints: bool) -> list[Target]:
    path = Path(arg).expanduser()
    if not path.exists():
        try:
            model_source(arg)  # a builtin or a hub id; anything else names a local path
        except ValueError as e:
            folder = re.search(r"\(.*\)$", str(e))  # `runs/typo`: `runs/` is a local folder
            raise TargetError(
                f"{arg}: checkpoint not found{' ' + folder.group() if folder else ''}"
            ) from None
        return [Target(arg, "hub", arg)]
    path = path.resolve()
    if _is_run(path):
        return _run_targets(path, all_checkpoints)
    if path.parent.name == run_dir.CHECKPOINTS and _is_run(path.parent.parent):
        problem = checkpoint.check_files(path)
        if problem is not None:
            raise TargetError(f"{arg}: incomplete checkpoint: {problem}")
        return [Target(f"{path.parent.parent.name}/{path.name}", "step", str(path))]
    if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        return [Target(_model_label(path), "adapter", str(path))]
    if (path / "config.json").is_file():
        target = Target(_model_label(path), "model", str(path))
        target.model_dir()  # a local directory: checked now, in milliseconds
        return [target]
    raise TargetError(
        f"{arg}: neither an HF model directory (config.json), a PEFT adapter ({ADAPTER_CONFIG}), a run "
        "directory (config.toml) nor a saved step"
    )


def _is_run(path: Path) -> bool:
    return run_dir.is_run_dir(path) and any(
        (path / name).is_dir() for name in (run_dir.EXPORT, run_dir.ADAPTER, run_dir.CHECKPOINTS)
    )


def _run_targets(run: Path, all_checkpoints: bool) -> list[Target]:
    if all_checkpoints:
        steps = checkpoint.complete_steps(run)
        if not steps:
            raise TargetError(f"{run}: no complete checkpoint under checkpoints/")
        return [Target(f"{run.name}/{p.name}", "step", str(p)) for p in steps]
    export = run / run_dir.EXPORT
    adapter = run / run_dir.ADAPTER
    if not (export / "config.json").is_file() and (adapter / ADAPTER_CONFIG).is_file():
        return [Target(f"{run.name}/{run_dir.ADAPTER}", "adapter", str(adapter))]
    if not (export / "config.json").is_file():
        raise TargetError(
            f"{run}: the run has no export/ (not finished, or checkpoint.export_hf = false); "
            "pass --all-checkpoints or one step, e.g. {run}/checkpoints/step-NNNNNN".replace(
                "{run}", str(run)
            )
        )
    target = Target(f"{run.name}/export", "model", str(export))
    target.model_dir()
    return [target]


def _model_label(path: Path) -> str:
    return f"{path.parent.name}/{path.name}" if run_dir.is_run_dir(path.parent) else path.name


def _file_stats(directory: Path) -> list:
    stats = [str(directory)]
    for p in sorted(directory.iterdir()):
        if p.is_file():
            st = p.stat()
            stats.append([p.name, st.st_size, st.st_mtime_ns])
    return stats


def stable_hash(obj: object) -> str:
    """A short digest of a JSON-able value: cache keys and folder names."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


# --- DCP step -> HF directory --------------------------------------------------------------------


def export_step(step: Path) -> Path:
    """The HF export of a saved step or a PEFT adapter, converted on first use into `$M2PO_CACHE/exports/`.

    A step: the run's `config.toml` names the base model, whose config maps the DCP checkpoint's model
    entries (not the optimizer state) to HF names; no learner is built. An adapter: merged into the
    base model its `adapter_config.json` names. Written to a temporary directory and renamed into
    place, so a killed conversion leaves nothing that looks finished.
    """
    from m2po_cli.models import cache_root

    run = step.parent.parent
    final = cache_root() / "exports" / f"{run.name}-{step.name}-{stable_hash(_file_stats(step))}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=final.parent))
    try:
        if (step / ADAPTER_CONFIG).is_file():
            _merge_adapter(step, tmp)
        else:
            _convert(step, run, tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # not a concurrent conversion that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(step: Path, run: Path, out: Path) -> None:
    from m2po_cli.hf_weights import read_checkpoint, write_hf
    from m2po_cli.lora import merge_titan
    from m2po_cli.models import resolve_model
    from m2po_cli.titan import load_arch

    recipe = run_dir.read_recipe(run)  # its data file may not be where eval runs: it is not needed
    base = resolve_model(recipe.model.path)
    adapter = load_arch(base).adapter
    state = checkpoint.read_model(step)
    if recipe.lora.enabled:  # the step holds the adapter alone
        saved, state = state, adapter.from_hf(read_checkpoint(base))
        merge_titan(state, saved, recipe.lora.alpha / recipe.lora.rank)
    write_hf(out, adapter.to_hf(state), base, recipe.model.dtype)


def _merge_adapter(folder: Path, out: Path) -> None:
    from m2po_cli.hf_weights import read_checkpoint, write_hf
    from m2po_cli.lora import merge, read_adapter
    from m2po_cli.models import resolve_model

    base_name = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    try:
        base = resolve_model(base_name)
    except (ModelError, ValueError) as e:
        raise TargetError(f"{folder}: the adapter's base model {base_name!r}: {e}") from None
    import torch

    tensors, scale = read_adapter(folder)
    hf_state = read_checkpoint(base)
    merge(hf_state, tensors, scale)
    bf16 = all(v.dtype == torch.bfloat16 for v in hf_state.values())  # as the base model holds them
    write_hf(out, hf_state, base, "bfloat16" if bf16 else "float32")
