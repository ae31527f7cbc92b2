"""Weights from the learner to rollout servers in their own processes (separate mode).

Two transports of one shape, picked by `rollout.weight_transport`:

- `nccl` (GPUs): vLLM's native weight-transfer engine. Learner rank 0 and every GPU worker of every
  server form one NCCL group; rank 0 broadcasts the weights in packed buffers while the servers
  receive them into a layer-wise reload (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`). Servers need `--weight-transfer-config
  '{"backend": "nccl"}'` (a started server gets it).
- `shm` (anywhere the servers share the learner's host; the CPU's only choice): rank 0 writes each
  HF-named tensor to its own safetensors file under shared memory and frees it; each server reloads
  the folder through `/collective_rpc` (the project's worker extension, which also re-derives a tied
  output layer).

Either way every learner rank walks the model parameter by parameter (`Learner.hf_weights`; each
`full_tensor()` is a collective), so no rank holds more than one full parameter beyond its shard and
nothing is pickled. The servers are paused while they load (requests in flight stay, and go on
under the new weights); then each gets the learner's version (`/update_weight_version`) and must
report it back on `/weight_info`, or the run stops.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from m2po_cli.rollout.server import Load


def shm_root() -> Path:
    """Shared memory (a RAM filesystem) where the OS has one, else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


PREFIX = "m2po-weights-"


def sweep_orphans(root: Path) -> list[Path]:
    """Remove weight folders left in `root` by runs that were killed (their process is gone).

    Shared memory is RAM: a killed 8B run would otherwise keep up to 16 GB of it until reboot."""
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        match = re.fullmatch(rf"{PREFIX}.*-pid(\d+)-\w+", folder.name)
        if match is None or _alive(int(match.group(1))):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path) -> int:
    """Write each tensor to `out_dir/NNNNN.safetensors`; return the bytes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    num_bytes = 0
    for i, (name, tensor) in enumerate(tensors):
        save_file({name: tensor.contiguous().cpu()}, str(out_dir / f"{i:05d}.safetensors"))
        num_bytes += tensor.numel() * tensor.element_size()
    return num_bytes


class WeightTransport:
    """After every `sync_every` updates, send the learner's weights to the rollout servers.

    `swap(load, version)` is the rank-0 side: it pauses the engines, runs `load(servers)`, sets and
    checks their version and resumes them (`RolloutProducer.swap`). It is None on the other ranks,
    which still walk the parameters with rank 0 (`full_tensor()` is a collective).
    """

    def __init__(
        self, rank: int, sync_every: int, dtype: torch.dtype, swap: Callable[[Load, int], None] | None
    ):
        self.rank, self.sync_every, self.dtype, self.swap = rank, sync_every, dtype, swap
        self.swept: list[Path] = []  # weight folders of killed runs removed at start
        self.seconds = 0.0  # totals since the last `take_metrics()`
        self.num_bytes = 0
        self.num_syncs = 0

    def after_update(self, learner) -> None:
        """The `train_on` hook: sync when the learner's version reaches a multiple of `sync_every`."""
        if learner.version % self.sync_every == 0:
            self.push(learner)

    def push(self, learner) -> None:
        t0 = time.perf_counter()
        self.num_bytes += self._send(learner)
        if self.swap is not None:
            self.seconds += time.perf_counter() - t0
            self.num_syncs += 1

    def _send(self, learner) -> int:
        """Every rank: move the weights; rank 0 (through `swap`) also loads them. Returns bytes sent."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until the servers hold the last weights pushed (a push may return before they do)."""

    def take_metrics(self) -> dict[str, float]:
        m = {
            "perf/weight_sync_s": self.seconds,
            "perf/weight_sync_bytes": float(self.num_bytes),
            "perf/weight_syncs": float(self.num_syncs),
        }
        self.seconds, self.num_bytes, self.num_syncs = 0.0, 0, 0
        return m

    def remove_files(self) -> None:
        """What the transport keeps outside the process (shared memory), removed; any thread may call it."""

    def close(self) -> None:
        self.remove_files()


class ShmWeightTransport(WeightTransport):
    """Safetensors files in shared memory, one per parameter, reloaded by each server.

    The learner only writes the files: the servers load them on a thread of rank 0 while the
    learner goes on with its next update, and the next push first waits for that load, so shared
    memory never holds more than one copy of the model and the engines' versions stay in order."""

    def __init__(self, rank, sync_every, dtype, swap, tag: str):
        super().__init__(rank, sync_every, dtype, swap)
        self.folder = None
        self.loading: threading.Thread | None = None
        self.load_error: BaseException | None = None
        if swap is not None:  # only the rank that writes needs a folder
            self.swept = sweep_orphans(shm_root())
            self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{tag}-pid{os.getpid()}-", dir=shm_root()))

    def _send(self, learner) -> int:
        tensors = learner.hf_weights(self.dtype)
        if self.swap is None:
            for _ in tensors:  # the other ranks take part in every full_tensor() gather
                pass
            return 0
        self.wait()
        out = self.folder / f"v{learner.version:08d}"
        num_bytes = write_safetensors(tensors, out)
        self.loading = threading.Thread(target=self._load, args=(out, learner.version), name="weight-load")
        self.loading.start()
        return num_bytes

    def _load(self, out: Path, version: int) -> None:
        try:
            self.swap(lambda servers: [s.load_weights(out) for s in servers], version)
        except BaseException as e:  # noqa: BLE001 (raised on the learner's thread by `wait`)
            self.load_error = e
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def wait(self) -> None:
        """Until the servers hold the last weights pushed; raises what their load raised."""
        if self.loading is not None:
            self.loading.join()
            self.loading = None
        if self.load_error is not None:
            error, self.load_error = self.load_error, None
            raise error

    def remove_files(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        try:
            if self.loading is not None:
                self.loading.join()
        finally:
            self.remove_files()


def resolve_transport(choice: str) -> str:
    """`rollout.weight_transport`: auto is nccl where CUDA is, else shm."""
    from m2po_cli.errors import RunError

    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "shm"
    if choice == "nccl" and not torch.cuda.is_available():
        raise RunError(
            "rollout.weight_transport: nccl needs CUDA on the learner; this machine has none (use shm)"
        )
    return choice
