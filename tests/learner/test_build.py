"""The learner's build: rank 0 alone reads the checkpoint and every rank ends with exactly its shard
of it; every process group of the mesh waits the recipe's collective timeout; a model sharded over
several nodes without replicas gets the one-line HSDP suggestion."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m2po_cli.models import resolve_model
from m2po_cli.titan import load_arch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "dist_build_worker.py"
TIMEOUT_MINUTES = 47  # neither the recipe default (60) nor torch's (30 for gloo, 10 for NCCL)
SUGGESTION = "parallel.dp_replicate is 1 on 2 nodes"


def decoy_of(model_dir: Path, folder: Path) -> Path:
    """`model_dir`'s files, but every safetensors file replaced by bytes that are not safetensors."""
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.name.endswith(".safetensors"):
            (folder / f.name).write_bytes(b"not a safetensors file\n" * 64)
        elif f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(out: Path, model_dir: Path, nodes: int, procs: int, *overrides: str) -> str:
    """The worker under torchrun on `nodes` loopback nodes (one agent each) of `procs` processes;
    rank 0 reads `model_dir`, every other rank a decoy of it. Returns the agents' output."""
    out.mkdir()
    decoy = decoy_of(model_dir, out / "decoy")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    sets = [f"run.collective_timeout_minutes={TIMEOUT_MINUTES}", *overrides]
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=m2po"]
    worker = [str(WORKER), str(out), str(model_dir), str(decoy), *sets]
    agents = []
    for node in range(nodes):
        shape = ["--nnodes", str(nodes), "--nproc-per-node", str(procs), "--node-rank", str(node)]
        cmd = [sys.executable, "-m", "torch.distributed.run", *shape, *rendezvous, *worker]
        agents.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-4000:]
    return "\n".join(outputs)


def assert_shards_are_the_checkpoints(model_dir: Path, ranks: list[dict]) -> None:
    """Every rank's shard of every tensor equals, bit for bit, that slice of the checkpoint as the
    adapter converts it, cast to the shard's dtype (what loading the checkpoint on the rank gives)."""
    hf_state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf_state.update(load_file(str(f)))
    full = load_arch(model_dir).adapter.from_hf(hf_state)
    for rank, result in enumerate(ranks):
        assert result["shards"].keys() == full.keys(), rank
        for name, (local, offset) in result["shards"].items():
            where = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            expected = full[name][where].to(local.dtype)
            assert torch.equal(local, expected), f"rank {rank}: {name}"
    assert any(result["shards"][name][0].numel() for result in ranks[1:] for name in full)


def assert_every_group_waits_the_recipes_timeout(ranks: list[dict], mesh_groups: set[str]) -> None:
    """Every backend of every group a rank belongs to (torch would give the mesh's 30 minutes), the
    mesh dimensions `mesh_groups` among them."""
    for rank, result in enumerate(ranks):
        timeouts = result["timeouts"]
        assert {minutes for _, _, minutes in timeouts} == {TIMEOUT_MINUTES}, (rank, timeouts)
        assert mesh_groups <= {desc.split(" ")[0] for desc, _, _ in timeouts}, (rank, timeouts)


def test_two_nodes_fsdp_rank0_reads_and_suggests_hsdp(tmp_path):
    """Two nodes of one rank each, plain FSDP: rank 1 never reads the checkpoint (its files are a
    decoy) yet holds exactly its half; the run suggests HSDP once."""
    model_dir = resolve_model("builtin:tiny-qwen3-untied")
    output = build(tmp_path / "run", model_dir, 2, 1)
    ranks = [torch.load(tmp_path / "run" / f"rank{r}.pt") for r in range(2)]
    assert_shards_are_the_checkpoints(model_dir, ranks)
    assert_every_group_waits_the_recipes_timeout(ranks, {"default_pg"})
    assert output.count(SUGGESTION) == 1, output[-4000:]


def test_one_node_hsdp_with_checkpointing_and_tied_embeddings(tmp_path):
    """Four ranks as two replicas of two shards each (every mesh dimension a real group), the blocks
    wrapped for activation checkpointing, the output layer tied to the embedding: ranks 1-3 read no
    checkpoint and hold exactly their shards; no suggestion on one node."""
    model_dir = resolve_model("builtin:tiny-qwen3")
    sets = ["parallel.dp_replicate=2", 'train.activation_checkpointing="full"']
    output = build(tmp_path / "run", model_dir, 1, 4, *sets)
    ranks = [torch.load(tmp_path / "run" / f"rank{r}.pt") for r in range(4)]
    assert_shards_are_the_checkpoints(model_dir, ranks)
    assert_every_group_waits_the_recipes_timeout(ranks, {"default_pg", "mesh_dp_replicate", "mesh_fsdp"})
    assert SUGGESTION.split(" on ")[0] not in output
