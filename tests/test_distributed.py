"""The process group's backends: a GPU run's group takes host and device tensors alike, and the
suite's groups refuse what the GPU's group would (`tests/device_rule.py`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2po_cli.distributed import backend_spec
from tests.device_rule import device_types, gpu_group_on_cpu

ROOT = Path(__file__).resolve().parents[1]
# One host-tensor all-reduce in a one-rank group built by `init_distributed`.
HOST_ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "from m2po_cli.distributed import init_distributed\n"
    "init_distributed()\n"
    "x = torch.ones(2)\n"
    "dist.all_reduce(x)\n"
    "print(dist.get_backend(), float(x.sum()))\n"
)


def host_all_reduce(spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "M2PO_DIST_BACKEND": spec, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", HOST_ALL_REDUCE], env=env, capture_output=True, text=True, timeout=120
    )


def test_gpu_group_has_a_backend_for_host_and_device_tensors():
    assert device_types(backend_spec(on_gpu=True)) == ["cpu", "cuda"]
    assert dict(p.split(":") for p in backend_spec(on_gpu=True).split(",")) == {"cpu": "gloo", "cuda": "nccl"}
    assert backend_spec(on_gpu=False) == "gloo"
    assert os.environ["M2PO_DIST_BACKEND"] == gpu_group_on_cpu() == "cpu:gloo,cuda:gloo"


@pytest.mark.parametrize("spec", ["nccl", "cuda:nccl"])
def test_a_device_only_group_refuses_a_host_tensor_on_the_cpu_too(spec):
    """What the suite's groups check: a group whose GPU form is NCCL alone becomes `cuda:gloo` here,
    and a host tensor's collective fails as it would under NCCL."""
    done = host_all_reduce(gpu_group_on_cpu(spec))
    assert done.returncode != 0
    assert "No backend type associated with device type cpu" in done.stderr


def test_the_gpu_group_on_cpu_takes_a_host_tensor():
    done = host_all_reduce(gpu_group_on_cpu())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu:gloo,cuda:gloo", "2.0"]
