"""The `vllm serve` process of one rollout engine: its command, environment and start, and how it
is stopped. All that `m2po serve` needs; `server.EngineServer` talks to the process once it runs.

A server the run starts shares the run's process group, so killing that group (kill -9 included)
takes the engine along; it also gets a parent-death signal, and on a CPU all of its processes stay
on the cores its compute threads are bound to.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil

from m2po_cli.config import RolloutConfig
from m2po_cli.rollout.settings import cli_flags, cpu_threads, engine_args

SERVED_NAME = "policy"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(cores: set[int] | None) -> Callable[[], None]:
    """What the server's process does between fork and exec: die with the run, and on a CPU keep
    all of its processes (API server, engine core, workers) on the cores its compute threads are
    bound to, off the learner's."""

    def setup() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def bound_cores(bind: str) -> set[int]:
    """The cores of a `VLLM_CPU_OMP_THREADS_BIND` value ("0-3", "0,2", "0-1|2-3"; "all" or "auto": none)."""
    if bind in ("all", "auto", "nobind", ""):
        return set()
    cores: set[int] = set()
    for part in bind.replace("|", ",").split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def serve_command(
    model_dir: Path,
    cfg: RolloutConfig,
    dtype: str,
    max_model_len: int,
    port: int,
    host: str = "127.0.0.1",
    lora: tuple[int, int] = (0, 1),
) -> list[str]:
    """The `vllm serve` command of one engine: the project's engine settings (`settings.engine_args`,
    as a rollout engine), served on `host` (loopback for the engines a run starts) under one name.
    `lora`: (rank, slots) of the adapters it serves (rank 0: none)."""
    rank, slots = lora
    args = engine_args(
        model_dir, cfg, dtype=dtype, max_model_len=max_model_len, on_gpu=_on_gpu(), behaviour_logprobs=True,
        lora_rank=rank, lora_slots=slots,
    )  # fmt: skip
    cmd = [
        # The module behind `vllm serve`: the `vllm` script itself looks up package metadata that
        # the CPU build (distributed as vllm-cpu) does not have.
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *cli_flags(args),
        "--host", host, "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--api-server-count", "1",
        "--disable-uvicorn-access-log",
        "--enable-scale-out",  # the token-in/token-out route, with per-token weight versions
    ]  # fmt: skip
    if _on_gpu() and cfg.weight_transport != "shm":  # auto or nccl: the learner sends over vLLM's NCCL engine
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def server_env(devices: list[int] | None, lora: bool = False) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if lora:  # the adapter load and unload routes
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not _on_gpu():
        for name, value in cpu_threads(0, 1).items():  # every core: the server is its host's only engine
            env.setdefault(name, value)
    # The worker extension is imported inside the server: it must find this package.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def spawn(
    model_dir: Path,
    cfg: RolloutConfig,
    dtype: str,
    max_model_len: int,
    log_path: Path,
    devices: list[int] | None = None,
    lora: tuple[int, int] = (0, 1),
) -> tuple[subprocess.Popen, int]:
    """Start `vllm serve` on a free local port, its output in `log_path`; (the process, the port).

    `devices` are the GPU indices the engine may use (None: the CPU, or every visible GPU); `lora` as
    in `serve_command`."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = server_env(devices, lora=lora[0] > 0)
    cores = None if _on_gpu() else bound_cores(env.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            serve_command(model_dir, cfg, dtype, max_model_len, port, lora=lora),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_child_setup(cores),
        )
    return proc, port


def stop_tree(pid: int, grace_s: float = 20.0, also: list[psutil.Process] = ()) -> None:
    """SIGTERM a process, its descendants and the processes `also` (they may have outlived their
    parent), SIGKILL whatever is left after `grace_s`."""
    procs = [p for p in also if p.is_running()]  # is_running also rules out a reused pid
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True), *procs]
    except psutil.NoSuchProcess:
        pass
    if not procs:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
