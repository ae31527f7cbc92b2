"""The process group and the collectives on host values that the learner and the loop share.

One code path serves one process (a one-rank gloo group) and `torchrun` (gloo on CPU, NCCL on GPU).
NCCL takes only device tensors, so a collective on host values (metrics, counts) moves them to the
rank's GPU and back.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout: timedelta | None = None) -> tuple[int, int]:
    """Join torchrun's group, or make a one-rank group, so one code path serves both.

    `timeout` bounds every collective (NCCL's default, 10 minutes, is shorter than a rollout batch
    of the paper's size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # before NCCL starts, so each rank's communicator uses its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # A private folder for the store's file, removed at exit (FileStore leaves its file behind).
        store_dir = tempfile.mkdtemp(prefix="m2po-pg-")
        atexit.register(shutil.rmtree, store_dir, ignore_errors=True)
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """`x` reduced over every rank (a copy; on the GPU for NCCL, back on the host after)."""
    if dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        y = x.to(device) if device else x.clone()
        dist.all_reduce(y, op=op)
        return y.cpu()
    return x


def gather(values_N: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's 1-D `values_N` (any lengths) over `group`, concatenated in rank order; identical
    on all ranks (None: this rank's alone)."""
    if group is None:
        return values_N
    size = torch.tensor([values_N.numel()], device=values_N.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]  # one host sync per optimizer step, not per token
    padded = values_N.new_zeros(max(max(sizes), 1))
    padded[: values_N.numel()] = values_N
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def all_reduce_group(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` reduced in place over `group` (None: this rank alone); for tensors already on the device."""
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x
