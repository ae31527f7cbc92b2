"""The process group and the collectives on host values that the learner and the loop share.

One code path serves one process (a one-rank gloo group) and `torchrun`. On a GPU the group has two
backends (`backend_spec`): NCCL for device tensors and gloo for host ones (metrics, counts, the
log-ratios the global mask is computed from), so a collective takes a tensor wherever it lives.
NCCL alone refuses host tensors; gloo alone is slow for the parameters FSDP2 gathers.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from m2po_cli.torchrun import launch


def backend_spec(on_gpu: bool) -> str:
    """The process group's backend for each device type: on a GPU, NCCL for CUDA tensors beside gloo
    for host tensors; on the CPU, gloo."""
    return "cpu:gloo,cuda:nccl" if on_gpu else "gloo"


def init_distributed(timeout: timedelta | None = None) -> tuple[int, int]:
    """Join torchrun's group, or make a one-rank group, so one code path serves both.

    `timeout` bounds every collective (NCCL's default, 10 minutes, is shorter than a rollout batch
    of the paper's size). `M2PO_DIST_BACKEND` replaces `backend_spec` (torch's form,
    `device:backend,...`; the tests build the GPU's group with gloo in place of NCCL)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    on_gpu, shape = torch.cuda.is_available(), launch()
    backend = os.environ.get("M2PO_DIST_BACKEND") or backend_spec(on_gpu)
    if on_gpu:  # before NCCL starts, so each rank's communicator uses its own GPU
        torch.cuda.set_device(shape.local_rank)
    if shape.torchrun:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # A private folder for the store's file, removed at exit (FileStore leaves its file behind).
        store_dir = tempfile.mkdtemp(prefix="m2po-pg-")
        atexit.register(shutil.rmtree, store_dir, ignore_errors=True)
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def set_group_timeouts(timeout: timedelta) -> None:
    """Give every process group this rank belongs to `timeout` (both backends of a two-backend one).

    torch creates a group (`new_group`, `split_group`, a device mesh's dimensions) with its own
    default timeout, 30 minutes for gloo and 10 for NCCL, not the default group's, so an HSDP mesh's
    groups would cut a wait short that `init_distributed`'s timeout allows. Groups of torchtitan's
    "fake" backend, for mesh dimensions of size 1, run no collective and are left alone."""
    c10d = dist.distributed_c10d
    for group, (backend, _) in list(c10d._world.pg_map.items()):
        if backend != "fake":
            c10d._set_pg_timeout(timeout, group)


def transfer_device() -> torch.device | None:
    """Where bulk collectives (rows, tokens) travel: the rank's GPU, whose backend (NCCL) is the
    fast one; None on the CPU (host tensors stay where they are)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """`x` reduced over every rank (a copy; `x` stays untouched)."""
    if dist.get_world_size() > 1:
        y = x.clone()
        dist.all_reduce(y, op=op)
        return y
    return x


def gather(
    values_N: torch.Tensor, group: dist.ProcessGroup | None, via: torch.device | None = None
) -> torch.Tensor:
    """Every rank's 1-D `values_N` (any lengths) over `group`, concatenated in rank order; identical
    on all ranks, on `values_N`'s device (None: this rank's alone). The values travel on `via`
    (default: where they are), e.g. `transfer_device()` for host values that NCCL should carry."""
    if group is None or dist.get_world_size(group) == 1:
        return values_N
    local = values_N.to(via) if via is not None else values_N
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]  # one host sync per call, not per value
    padded = local.new_zeros(max(max(sizes), 1))
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)]).to(values_N.device)


def world_group() -> dist.ProcessGroup | None:
    """The group of every rank, or None when this process is the only one."""
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def all_reduce_group(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` reduced in place over `group` (None: this rank alone); for tensors already on the device."""
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def add_into(totals: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """Add each of `values` (detached, float32, on the host) into `totals`, by key."""
    for k, v in values.items():
        totals[k] = totals.get(k, 0) + v.detach().float().cpu()


def sum_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each value summed over every rank (float64), in one all-reduce; every rank passes the same keys."""
    if not values:
        return values
    keys = sorted(values)
    flat = torch.stack([torch.as_tensor(values[k], dtype=torch.float64) for k in keys])
    return dict(zip(keys, all_reduce(flat, dist.ReduceOp.SUM), strict=True))


def as_bytes(values: list[Tensor]) -> Tensor:
    """Tensors of one length as the columns of one `[length, bytes]` uint8 tensor."""
    n = values[0].shape[0]
    return torch.cat([v.contiguous().view(torch.uint8).view(n, v.element_size()) for v in values], dim=1)


def from_bytes(data: Tensor, names: list[str], dtypes: list[torch.dtype]) -> dict[str, Tensor]:
    """The tensors `as_bytes` joined, back by name."""
    out, start = {}, 0
    for name, dtype in zip(names, dtypes, strict=True):
        width = torch.empty(0, dtype=dtype).element_size()
        out[name] = data[:, start : start + width].contiguous().view(dtype).view(-1)
        start += width
    return out


def all_to_all_rows(x: Tensor, send: list[int], receive: list[int], group, device) -> Tensor:
    """Rows of `x` split by `send` to each rank; `receive[r]` rows come back from rank r."""
    out = x.new_empty((sum(receive), *x.shape[1:]), device=device)
    dist.all_to_all_single(out, x.to(device) if device else x, receive, send, group=group)
    return out.cpu()
