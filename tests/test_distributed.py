"""The process group's backends: a GPU run's group takes host and device tensors alike, and the
suite's groups refuse what the GPU's group would (`tests/device_rule.py`). A hub model is downloaded
once a node, by its local rank 0, for all its ranks."""

import json
import os
import shutil
import socket
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


# --- one model download a node (`models._download`) ------------------------------------------------

HUB_ID = "fake-org/fake-model"
# Resolves argv[2] as a recipe's model path, counting the hub calls it makes; writes what it got.
RESOLVE = """\
import json, os, sys
from pathlib import Path
import huggingface_hub
from m2po_cli.models import ModelError, resolve_model
real, calls = huggingface_hub.snapshot_download, []
def counting(*args, **kwargs):
    calls.append(args[0])
    return real(*args, **kwargs)
huggingface_hub.snapshot_download = counting
try:
    got = {"path": str(resolve_model(sys.argv[2]))}
except ModelError as e:
    got = {"error": str(e)}
(Path(sys.argv[1]) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({**got, "calls": calls}))
"""


def fake_hub_cache(cache: Path) -> Path:
    """An offline hub cache holding one snapshot of `HUB_ID` (the layout huggingface_hub keeps); its folder."""
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    return snapshot


def resolve_on(tmp_path: Path, path: str, nodes: int, procs: int) -> list[dict]:
    """What each of `nodes` x `procs` ranks (loopback nodes, one torchrun each; one plain process for
    1 x 1) got for model path `path`, with the hub offline: its answer and its hub calls, by rank."""
    out, script = tmp_path / "out", tmp_path / "resolve.py"
    out.mkdir()
    script.write_text(RESOLVE)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
    }
    launchers = [[sys.executable]]
    if nodes * procs > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{s.getsockname()[1]}"]
        shape = ["--nnodes", str(nodes), "--nproc-per-node", str(procs)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", *shape, *rendezvous]
        launchers = [[*torchrun, "--node-rank", str(node)] for node in range(nodes)]
    agents = [
        subprocess.Popen(
            [*launch, str(script), str(out), path], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        for launch in launchers
    ]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nodes * procs)]


def test_one_download_a_node(tmp_path):
    """Two nodes of two ranks: each node's local rank 0 asks the hub, once; its other rank never does
    and reads the same snapshot."""
    snapshot = fake_hub_cache(tmp_path / "hub")
    got = resolve_on(tmp_path, HUB_ID, nodes=2, procs=2)
    assert [g["calls"] for g in got] == [[HUB_ID], [], [HUB_ID], []]
    assert {g["path"] for g in got} == {str(snapshot)}


def test_a_failed_download_fails_the_whole_node_with_its_line(tmp_path):
    """A hub id the (offline) hub cannot give: local rank 0 asks once; the other rank fails with the
    same line without asking."""
    fake_hub_cache(tmp_path / "hub")
    got = resolve_on(tmp_path, "fake-org/absent", nodes=1, procs=2)
    assert [g["calls"] for g in got] == [["fake-org/absent"], []]
    assert got[0]["error"] == got[1]["error"]
    assert got[0]["error"].startswith(
        "fake-org/absent: not a local directory, and the hub did not provide it"
    )


def test_one_process_and_a_local_folder_resolve_alone(tmp_path):
    """Without torchrun the process asks the hub itself; a local folder never reaches the hub."""
    snapshot = fake_hub_cache(tmp_path / "hub")
    assert resolve_on(tmp_path, HUB_ID, nodes=1, procs=1) == [{"path": str(snapshot), "calls": [HUB_ID]}]
    shutil.rmtree(tmp_path / "out")
    got = resolve_on(tmp_path, str(snapshot), nodes=1, procs=2)
    assert got == [{"path": str(snapshot), "calls": []}] * 2
