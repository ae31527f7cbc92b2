"""NCCL's device rule on the CPU: the process group a GPU run builds, with gloo in place of NCCL.

NCCL takes only CUDA tensors; gloo takes anything, so a CPU suite on plain gloo never sees a host
tensor handed to a device-only group. `gpu_group_on_cpu` keeps the device types of the GPU's group
(`backend_spec(on_gpu=True)`) and gives each one gloo: a device type the GPU's group has no backend
for has none here either, and a collective on such a tensor fails on the CPU as it would under NCCL
("No backend type associated with device type cpu"). The suite builds every process group this way
(`M2PO_DIST_BACKEND`, set in conftest.py and inherited by every command a test starts).
"""

from __future__ import annotations

import torch.distributed as dist

from m2po_cli.distributed import backend_spec


def device_types(spec: str) -> list[str]:
    """The device types a backend spec serves: `cpu:gloo,cuda:nccl` -> cpu, cuda; `nccl` -> cuda."""
    types: list[str] = []
    for part in spec.split(","):
        if ":" in part:
            types.append(part.split(":")[0])
        else:
            types += dist.Backend.backend_capability[part.lower()]
    return types


def gpu_group_on_cpu(spec: str | None = None) -> str:
    """The GPU's backend spec with gloo for each of its device types."""
    return ",".join(f"{device}:gloo" for device in device_types(spec or backend_spec(on_gpu=True)))
