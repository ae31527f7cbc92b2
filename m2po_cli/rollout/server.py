"""Rollout engines in their own processes: `vllm serve` started by the run, or servers already running.

The run talks to each server over HTTP: vLLM's token-in/token-out route (`/inference/v1/generate`,
served with `--enable-scale-out`) samples, returning token ids, behaviour logprobs and the weight
version of every token; the RL/dev routes of `VLLM_SERVER_DEV_MODE=1` control it (`/pause`,
`/resume`, `/collective_rpc`, `/update_weight_version`, `/weight_info`). A weight swap pauses with
`mode=keep`: requests in flight stay in the engine, their KV cache is recomputed under the new
weights, and they go on sampling with them, so no work is thrown away and each token's version is
the one whose weights sampled it. A server the run starts shares the run's process group, so killing
that group (kill -9 included) takes the engine along; it also gets a parent-death signal, and
`close()` stops every process the server started, even when the server itself has died.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import httpx
import psutil

from m2po_cli.config import RolloutConfig
from m2po_cli.errors import UserError
from m2po_cli.rollout.launch import SERVED_NAME, spawn, stop_tree
from m2po_cli.rollout.settings import WORKER_EXTENSION, is_finished, rollout_sampling
from m2po_cli.rollout.types import Completion

EXIT_GRACE_S = 5.0  # how long a dropped connection waits for a started server's process to end


class EngineError(UserError, RuntimeError):
    """The rollout server failed or disagrees with the learner; the message says which and how."""


class EngineServer:
    """One rollout server: its URL, and the process when this run started it."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: Path | None = None):
        self.url = url.rstrip("/")
        self.proc = proc
        self.log_path = log_path
        self.model_name = SERVED_NAME  # what requests name; read from the server at `check`
        self.max_num_seqs = 256  # the engine's concurrency, read at `check`
        self.children: list[psutil.Process] = []
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
        server = cls.spawn(model_dir, cfg, dtype, max_model_len, log_path, devices)
        try:
            server.wait_ready(cfg.server_start_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    @classmethod
    def spawn(cls, model_dir, cfg, dtype, max_model_len, log_path, devices=None, lora=(0, 1)) -> EngineServer:
        """`start` without the wait: the server loads its model meanwhile; `lora`: `serve_command`'s."""
        proc, port = spawn(model_dir, cfg, dtype, max_model_len, log_path, devices, lora)
        return cls(f"http://127.0.0.1:{port}", proc, log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the server answers /health (it loads the model meanwhile): one this run started,
        or one a job script starts beside the run (`rollout.attach_wait_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(
                    f"vllm serve exited with code {self.proc.returncode} while starting; see {self.log_path}"
                )
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    if self.proc is not None:
                        self._adopt_children()
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise EngineError(f"rollout server {self.url} did not answer /health within {timeout_s:.0f} s")

    def _adopt_children(self) -> None:
        """Remember the processes the server started (its engine core and workers): if the server
        dies alone, they are no longer its children, and `close()` must still stop them."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def check(self, signature: dict, max_model_len: int, lora_rank: int = 0) -> None:
        """Stop the run, in one line with the real reason, unless this is a vLLM server with the
        routes the run needs, serving a model of the learner's shape (`signature`, see
        `worker.model_signature`) with room for `max_model_len` tokens and behaviour logprobs, and
        adapters of `lora_rank` when it is not 0."""
        health = self._call("GET", "/health")
        if health.status_code != 200:
            raise self._refuse(
                f"answers HTTP {health.status_code} on /health: not a vLLM server, or not ready"
            )
        models = self._call("GET", "/v1/models").json().get("data") or []
        if not models:
            raise self._refuse("serves no model (/v1/models is empty)")
        self.model_name, served_len = models[0]["id"], models[0].get("max_model_len") or 0
        if served_len < max_model_len:
            raise self._refuse(
                f"serves at most {served_len} tokens per sequence; the recipe needs {max_model_len} "
                "(--max-model-len)"
            )
        hint = "start it with VLLM_SERVER_DEV_MODE=1 (vLLM's RL and dev routes)"
        info = self._call("GET", "/server_info", hint, params={"config_format": "json"})
        config = info.json()["vllm_config"]
        self.max_num_seqs = int(config["scheduler_config"]["max_num_seqs"])
        if config["model_config"].get("logprobs_mode") != "processed_logprobs":
            raise self._refuse(
                f"returns {config['model_config'].get('logprobs_mode')} logprobs, not those of the distribution "
                "it samples: start it with --logprobs-mode processed_logprobs"
            )
        if lora_rank and int((config.get("lora_config") or {}).get("max_lora_rank") or 0) < lora_rank:
            raise self._refuse(f"serves no LoRA adapters of rank {lora_rank}: start it with --enable-lora "
                               f"--max-lora-rank >= {lora_rank} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")  # fmt: skip
        probe = {"model": self.model_name, "token_ids": [0], "sampling_params": {"max_tokens": 1}}
        generate = self._call("POST", GENERATE, json=probe)
        if generate.status_code != 200:
            raise self._refuse(
                f"answers HTTP {generate.status_code} on {GENERATE}: start it with --enable-scale-out "
                f"({one_line(generate.text)})"
            )
        served = self.collective_rpc(
            "m2po_signature", hint=f"start it with --worker-extension-cls {WORKER_EXTENSION}"
        )
        differ = [k for k in signature if served.get(k) != signature[k]]
        if differ:
            shown = ", ".join(f"{k} {signature[k]} here, {served.get(k)} there" for k in differ)
            raise self._refuse(f"serves a model of another shape than the learner's ({shown})")

    def _call(self, verb: str, route: str, hint: str = "", **kw) -> httpx.Response:
        """One request of `check`; a failure to connect, and a 404 where `hint` says what enables the
        route, are refusals in one line."""
        try:
            response = self.http.request(verb, route, **kw)
        except httpx.TransportError as e:
            if why := self.exited(EXIT_GRACE_S):
                raise EngineError(why) from None
            if isinstance(e, httpx.ConnectError):
                raise self._refuse("refused the connection: is vllm serve running there?") from None
            raise self._refuse(f"{route}: {type(e).__name__}: {e}") from None
        if response.status_code == 404 and hint:
            raise self._refuse(f"has no {route} route: {hint}")
        return response

    def _refuse(self, reason: str) -> EngineError:
        return EngineError(f"rollout server {self.url} {reason}")

    def collective_rpc(self, method: str, *args: str, hint: str = "") -> object:
        """Call a worker-extension method on every worker; the first worker's answer."""
        response = self._call("POST", "/collective_rpc", json={"method": method, "args": list(args)})
        if response.status_code != 200:
            extra = f": {hint}" if hint else ""
            raise self._refuse(
                f"/collective_rpc {method}: HTTP {response.status_code}{extra} ({one_line(response.text)})"
            )
        results = response.json().get("results") or [None]
        return results[0]

    # --- control routes ---------------------------------------------------------------------------

    def exited(self, grace_s: float = 0.0) -> str | None:
        """Why a server this run started is gone (one line naming its log), or None while it runs.

        After a dropped connection pass a `grace_s`: a killed server's sockets close while its
        process is still exiting, so it is waited for that long before it counts as alive."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout=grace_s) if grace_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            pass
        if self.proc.returncode is None:
            return None
        return (
            f"rollout server {self.url} (vllm serve, pid {self.proc.pid}) exited with code "
            f"{self.proc.returncode}; see {self.log_path}"
        )

    def _lost(self, route: str, e: httpx.TransportError) -> EngineError:
        """A request to `route` got no answer: the server's exit when it is gone, else the error."""
        return EngineError(self.exited(EXIT_GRACE_S) or f"rollout server {self.url}{route}: {e}")

    def post(self, route: str, **kw) -> httpx.Response:
        try:
            response = self.http.post(route, **kw)
        except httpx.TransportError as e:
            raise self._lost(route, e) from None
        if response.status_code != 200:
            raise EngineError(
                f"rollout server {self.url}{route}: HTTP {response.status_code}: {one_line(response.text)}"
            )
        return response

    def pause(self) -> None:
        """Stop scheduling until `resume()`, keeping every request in flight where it is."""
        self.post("/pause", params={"mode": "keep", "clear_cache": "true"})

    def resume(self) -> None:
        self.post("/resume")

    def load_weights(self, weights_dir: Path) -> None:
        """Reload every worker from the safetensors files in `weights_dir` (HF names)."""
        self.collective_rpc("m2po_load_weights_from", str(weights_dir))

    def drop_kv_cache(self) -> None:
        """Forget every cached KV block, those of the requests kept in flight included: they are
        preempted and recomputed under the weights now loaded before they sample again."""
        response = self.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not response.json().get("success", False):
            raise EngineError(
                f"rollout server {self.url}/reset_prefix_cache: the KV cache could not be reset"
            )

    def world_size(self) -> int:
        """The engine's GPU workers (tensor x pipeline x data parallel): its ranks in a weight transfer."""
        try:
            return int(self.http.get("/get_world_size", params={"include_dp": "true"}).json()["world_size"])
        except httpx.TransportError as e:
            raise self._lost("/get_world_size", e) from None

    def set_version(self, version: int) -> None:
        self.post("/update_weight_version", json={"new_version": str(version)})

    def weight_version(self) -> str:
        try:
            return self.http.get("/weight_info").json()["weight_version"]
        except httpx.TransportError as e:
            raise self._lost("/weight_info", e) from None

    def check_version(self, version: int) -> None:
        """Stop the run if the engine does not report the learner's weight version."""
        reported = self.weight_version()
        if reported != str(version):
            raise EngineError(
                f"rollout server {self.url} reports weight version {reported!r} after a sync to "
                f"version {version}: another trainer may be updating it; give this run its own server"
            )

    def close(self, grace_s: float = 20.0) -> None:
        """Close the connection; if this run started the server, stop it and every process it
        started, whether or not the server itself is still alive (SIGKILL after `grace_s`)."""
        self.http.close()
        if self.proc is None:
            return
        stop_tree(self.proc.pid, grace_s, also=self.children)
        self.proc.wait()


GENERATE = "/inference/v1/generate"


def one_line(text: str, limit: int = 200) -> str:
    """A server's error body as one short line (an HTML page or a traceback is not an error line)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def sampling_body(
    prompt: list[int],
    cfg: RolloutConfig,
    seed: int,
    model: str = SERVED_NAME,
    max_tokens: int | None = None,
    echo: bool = False,
) -> dict:
    """A `GENERATE` request for `n` samples of one tokenized prompt (an episode's later turn: one, of
    at most `max_tokens`), untruncated sampling seeded per request (`settings.request_seed`). Tokens
    out, not text: the server does no per-token detokenizing on the engine's side (the run decodes
    the text itself, `parse_completions`). `echo`: the answer repeats the token ids the engine was
    given, for an episode to check against its own."""
    body = {
        "model": model,
        "token_ids": prompt,
        "sampling_params": {**rollout_sampling(cfg, seed, max_tokens), "detokenize": False},
        "output_mode": "tokens",
    }
    if echo:
        body["return_token_ids"] = True
    return body


def parse_completions(response: dict, decode: Callable[[list[int]], str]) -> list[Completion] | None:
    """The `n` completions of one `GENERATE` response in sample order, each token with the weight
    version that sampled it and its text `decode(token_ids)`; None if the engine aborted the request."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    if any(c["finish_reason"] == "abort" for c in choices):
        return None
    given = response.get("prompt_token_ids")
    return [
        Completion(
            token_ids=list(c["token_ids"]),
            logprobs=[float(entry["logprob"]) for entry in c["logprobs"]["content"]],
            text=decode(c["token_ids"]),
            finished=is_finished(c["finish_reason"]),
            versions=token_versions(c.get("weight_versions"), len(c["token_ids"])),
            prompt_ids=given,
        )
        for c in choices
    ]


async def generate(
    http: aiohttp.ClientSession, url: str, body: dict, decode: Callable[[list[int]], str], timeout_s: float
) -> list[Completion] | None:
    """One generate request (`sampling_body`) to the server at `url`, in the caller's session: its
    completions (None: aborted). Raises EngineError for an error answer or none within `timeout_s`
    (the session's timeout); aiohttp.ClientError for a connection that failed."""
    try:
        async with http.post(f"{url}{GENERATE}", json=body) as response:
            text = await response.text()
    except TimeoutError:
        raise EngineError(
            f"{url}{GENERATE}: no answer within {timeout_s:.0f} s (rollout.request_timeout_s)"
        ) from None
    if response.status != 200:
        raise EngineError(f"{url}{GENERATE}: HTTP {response.status}: {one_line(text)}")
    return parse_completions(json.loads(text), decode)


def server_sampler(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    cfg: RolloutConfig,
    decode: Callable[[list[int]], str],
    echo: bool,
    answered: Callable[[], None] | None = None,
    version: int | None = None,
) -> Callable[[list[int], int, int | None], Awaitable[list[Completion] | None]]:
    """`sample(token_ids, seed, max_tokens)`: one `generate` request of `sampling_body` to the server
    at `url`, its completions (None: aborted); what an episode samples its turns with. `answered()`
    hears of every answer. `version`: every token's (an adapter's), in place of the engine's spans."""

    async def sample(token_ids: list[int], seed: int, max_tokens: int | None) -> list[Completion] | None:
        body = sampling_body(token_ids, cfg, seed, model, max_tokens, echo)
        completions = await generate(http, url, body, decode, cfg.request_timeout_s)
        if answered is not None:
            answered()
        if version is not None and completions:
            completions = [replace(c, versions=[version] * len(c.token_ids)) for c in completions]
        return completions

    return sample


def token_versions(spans: list[dict] | None, num_tokens: int) -> list[int]:
    """vLLM's weight-version spans of one response, one version per token."""
    versions: list[int] = []
    for span in spans or []:
        if span["start"] != len(versions) or not str(span["version"]).isdigit():
            raise EngineError(f"the rollout server reported weight-version spans that do not tile: {spans}")
        versions += [int(span["version"])] * (span["end"] - span["start"])
    if len(versions) != num_tokens:
        raise EngineError(
            f"the rollout server reported weight versions for {len(versions)} of {num_tokens} tokens: {spans}"
        )
    return versions


Load = Callable[[list["EngineServer"]], None]  # puts the new weights into the (paused) servers


def swap_weights(servers: list[EngineServer], load: Load, version: int) -> None:
    """Pause every server (keeping its requests), `load(servers)`, drop the KV cache (kept requests
    recompute theirs under the new weights), tag and check the version, resume. Tokens sampled from
    here on carry `version`; the earlier tokens of a kept request keep theirs."""
    for s in servers:
        s.pause()
    try:
        load(servers)
        for s in servers:
            s.drop_kv_cache()
            s.set_version(version)
            s.check_version(version)
    finally:
        for s in servers:
            s.resume()
