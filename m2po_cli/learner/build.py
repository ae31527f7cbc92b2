"""The learner's model: the decoder built on the meta device, sharded on its mesh, then filled with
the checkpoint's weights (rank 0 alone reads them, `load_hf`), and with LoRA its adapter's start."""

from __future__ import annotations

import math
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch

from m2po_cli.config import Recipe
from m2po_cli.console import note
from m2po_cli.device import resolve_dtype
from m2po_cli.hf_weights import load_hf, plain_fqn
from m2po_cli.learner.parallelize import data_parallel_mesh, parallelize
from m2po_cli.lora import add_dropout, is_adapter_key
from m2po_cli.titan import ModelArch
from m2po_cli.torchrun import launch


def build_model(
    arch: ModelArch, recipe: Recipe, model_dir: Path, rank: int, world: int, device: torch.device
) -> torch.nn.Module:
    """The decoder of `arch` on its mesh with the checkpoint's weights. A collective."""
    with torch.device("meta"):
        model = arch.build()
    num_params = sum(p.numel() for p in model.parameters())
    if advice := recipe.parallel.layout_advice(world, launch().local_world, num_params):
        note(advice)
    replicas, shard = recipe.parallel.degrees(world)
    timeout = timedelta(minutes=recipe.run.collective_timeout_minutes)
    mesh = data_parallel_mesh(replicas, shard, world, timeout)
    dtype = resolve_dtype(recipe.model.dtype)
    parallelize(model, mesh, dtype, device.type, recipe.train.activation_checkpointing, world)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    initial = None
    if recipe.lora.enabled:
        add_dropout(model, recipe.lora.dropout)
        initial = partial(initial_adapter, model, recipe.run.seed)
    load_hf(model, arch.adapter, model_dir, rank, initial)
    if recipe.train.compile:
        model = torch.compile(model)
    return model


def initial_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's starting values, whole, under the model's FQNs: `A` Kaiming-uniform (PEFT's
    and torchtitan's init) from a generator seeded by the run's seed, `B` zeros, so the adapted model
    starts as the base. Rank 0 makes them and `load_hf` gives every rank its slice: the same adapter
    on any number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in model.state_dict().items():
        fqn = plain_fqn(name)
        if not is_adapter_key(fqn):
            continue
        tensor = torch.zeros(value.shape, dtype=value.dtype)
        if ".lora_a." in fqn:
            torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        state[fqn] = tensor
    return state
