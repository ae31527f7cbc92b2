"""Run by tests/learner/test_build.py under torchrun: a Learner built from a checkpoint that only rank
0 may read, and what each rank ended with.

    python tests/learner/dist_build_worker.py OUT MODEL DECOY [KEY=VALUE ...]   (recipe overrides)

Rank 0 builds from MODEL, every other rank from DECOY: MODEL's folder with safetensors files that are
not safetensors, so a rank other than 0 that read the weights itself would fail. Each rank writes its
shard of every tensor of the model's state dict with the shard's offset in the full tensor, and the
timeout of every process group it belongs to, to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from m2po_cli.config import load_recipe
from m2po_cli.hf_weights import plain_fqn
from m2po_cli.learner.policy import Learner
from m2po_cli.torchrun import launch

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"


def shards(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """(this rank's shard, its offset in the full tensor) of every entry of the model's state dict."""
    out = {}
    for name, value in model.state_dict().items():
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        out[plain_fqn(name)] = (value.to_local().detach().clone(), tuple(offset))
    return out


def group_timeouts() -> list[tuple[str, list[int], float]]:
    """(description, ranks, timeout in minutes) of every process group of this rank that talks: each
    backend's own setting, the one its collectives wait by."""
    c10d, found = dist.distributed_c10d, []
    for group, (backend, _) in c10d._world.pg_map.items():
        if backend == "fake":
            continue
        ranks = dist.get_process_group_ranks(group)
        for device in group._device_types:
            minutes = group._get_backend(device).options._timeout.total_seconds() / 60
            found.append((f"{group.group_desc} ({device.type})", ranks, minutes))
    return found


def main(out: Path, model: Path, decoy: Path, extra: list[str]) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe(QUICKSTART, extra)
    rank = launch().rank
    learner = Learner(model if rank == 0 else decoy, recipe)
    result = {"shards": shards(learner.model), "timeouts": group_timeouts()}
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
