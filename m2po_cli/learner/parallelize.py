"""The policy on its mesh, as torchtitan's `parallelize` places a model: the data-parallel mesh
(FSDP2, or HSDP across replicas), mixed precision, fused attention, activation checkpointing, and
gradients summed (not averaged) across ranks.

Gradients are SUMMED across ranks: each rank's loss is already divided by the global token count of
the optimizer batch, so the sum is the token-mean over the whole batch (and gloo has no
PREMUL_SUM/AVG reduce-scatter anyway).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from m2po_cli.distributed import set_group_timeouts
from m2po_cli.titan import ParallelDims, accept_attention_masks, use_fused_attention


def mixed_precision(dtype: str) -> MixedPrecisionPolicy | None:
    """For the engine's resolved dtype: in bf16 (what `auto` means on a GPU), fp32 master weights
    (the sharded parameters stay fp32), bf16 compute, fp32 gradient reduce; in fp32, none."""
    if dtype != "bfloat16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def data_parallel_mesh(replicate: int, shard: int, world: int, timeout: timedelta) -> DeviceMesh:
    """The mesh FSDP2 shards over, from torchtitan's parallel dims: `fsdp` (shard ranks) alone, or
    `dp_replicate` x `fsdp` for HSDP (gradients reduce-scattered within a shard group, then summed
    across the replicas). Every process group the mesh creates waits `timeout` in a collective, as
    the default group does (torch gives a mesh's groups its own default, not the default group's)."""
    dims = ParallelDims(
        dp_replicate=replicate,
        dp_shard=shard,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    set_group_timeouts(timeout)
    return dims.get_mesh(["dp_replicate", "fsdp"]) if replicate > 1 else dims.get_mesh("fsdp")


def parallelize(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    dtype: str,
    device_type: str,
    activation_checkpointing: str,
    world: int,
) -> None:
    """Shard the (meta) decoder over `mesh` in place: each block, then the root, as FSDP2 units in
    `dtype`'s mixed precision; fused attention that accepts masks; full activation checkpointing of
    every block when asked; gradient reduction as a sum when there is more than one rank."""
    mp = mixed_precision(dtype)
    kwargs = dict(mesh=mesh, **({"mp_policy": mp} if mp else {}))
    use_fused_attention(model, device_type, bf16=mp is not None)
    accept_attention_masks(model)
    if activation_checkpointing == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block))
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule) and world > 1:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
