"""The SLURM job scripts' network settings, with `srun` replaced by a recorder of what each step
would start with (no run starts): gloo and NCCL open their sockets on one named interface."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).resolve().parent
SCRIPTS = ["colocated.sbatch", "separate.sbatch"]
# Writes the socket variables each step sees, one line a step, and ends at once.
RECORDING_SRUN = """#!/bin/bash
echo "GLOO=${GLOO_SOCKET_IFNAME:-} NCCL=${NCCL_SOCKET_IFNAME:-}" >> "$RECORD"
"""


def steps(tmp_path: Path, script: str, **env: str) -> tuple[list[str], str]:
    """Each srun step's socket variables in a two-node job of `script` on loopback nodes, and the
    script's first line on stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(RECORDING_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "steps.txt"
    record.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    full_env = {
        **base,
        "PATH": os.pathsep.join([str(bin_dir), str(STAND_INS), os.environ["PATH"]]),
        "RECORD": str(record),
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "M2PO_PROCS_PER_NODE": "1",
        **env,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / script), "recipe.toml"],
        env=full_env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines(), done.stderr


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's `ip`")
@pytest.mark.parametrize("script", SCRIPTS)
def test_default_interface_is_the_route_between_the_nodes(tmp_path, script):
    """Unset, every step (the learner's and, in separate mode, each engine's) gets the interface the
    first node reaches the others through: loopback for these loopback nodes."""
    lines, stderr = steps(tmp_path, script)
    assert lines and set(lines) == {"GLOO=lo NCCL=lo"}
    assert "sockets on lo (gloo), lo (NCCL)" in stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_m2po_socket_ifname_names_it_and_the_callers_own_setting_wins(tmp_path, script):
    lines, _ = steps(tmp_path, script, M2PO_SOCKET_IFNAME="ib0")
    assert set(lines) == {"GLOO=ib0 NCCL=ib0"}
    lines, stderr = steps(tmp_path, script, M2PO_SOCKET_IFNAME="ib0", NCCL_SOCKET_IFNAME="=mlx5_0")
    assert set(lines) == {"GLOO=ib0 NCCL==mlx5_0"}
    assert "sockets on ib0 (gloo), =mlx5_0 (NCCL)" in stderr


def test_no_route_leaves_them_unset_and_says_so(tmp_path):
    lines, stderr = steps(tmp_path, "colocated.sbatch", SLURM_JOB_NODELIST="127.0.0.1,host.invalid")
    assert set(lines) == {"GLOO= NCCL="}
    assert "no route to host.invalid found: set M2PO_SOCKET_IFNAME" in stderr
