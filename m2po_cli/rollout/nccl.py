"""The NCCL weight transport of separate mode: vLLM's weight-transfer engine, learner to servers.

Learner rank 0 is rank 0 of a NCCL group whose other ranks are the GPU workers of every server,
server after server (`rank_offsets`). Each sync: the servers are paused, every learner rank walks
the model (`LearnerSource`: each `full_tensor()` is a collective), rank 0 broadcasts the HF-named
tensors in packed buffers while every server receives them concurrently into a layer-wise reload,
then the version is set and checked. vLLM's trainer engine does the broadcast; `FanOutClient` sends
its control calls to all servers at once, each with its own rank offset.

Bytes per sync: the model in the serving dtype, once over NCCL (16.4 GB for the 8B recipe in bf16),
in packed buffers of `PACKED_BUFFER_BYTES` (two in flight): the learner's extra GPU memory is one
full parameter (1.2 GB for the 8B model's embedding) plus the two buffers.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

import torch

from m2po_cli.rollout.launch import free_port
from m2po_cli.rollout.server import EngineError, EngineServer
from m2po_cli.rollout.transport import WeightTransport

PACKED_BUFFER_BYTES = 2**30


def rank_offsets(world_sizes: list[int]) -> list[int]:
    """Each server's first rank in the transfer group: learner rank 0 first, then the servers in turn."""
    offsets, next_rank = [], 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets


class FanOutClient:
    """vLLM's weight-sync client protocol over several servers: every call goes to all of them at once.

    They must run concurrently: each server's `update_weights` blocks in the NCCL receive until rank
    0 broadcasts, and the same for the rendezvous in `init_weight_transfer_engine`."""

    def __init__(self, servers: list[EngineServer], world_sizes: list[int]):
        self.servers, self.offsets = servers, rank_offsets(world_sizes)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(servers)))

    def _all(self, route: str, bodies: list[dict | None]) -> None:
        futures = [
            self.pool.submit(s.post, route, json=body) for s, body in zip(self.servers, bodies, strict=True)
        ]
        for f in futures:
            f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """vLLM's trainer writes one worker offset for a single server; each server gets its own."""
        self._all(
            "/init_weight_transfer_engine",
            [{"init_info": {**init_info, "rank_offset": off}} for off in self.offsets],
        )

    def start_weight_update(self) -> None:
        self._all("/start_weight_update", [None] * len(self.servers))

    def update_weights(self, update_info) -> None:
        self._all("/update_weights", [{"update_info": update_info}] * len(self.servers))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._all("/finish_weight_update", [body] * len(self.servers))

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("/shutdown_weight_transfer_engine", [None] * len(self.servers))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class Metadata(list):
    """A `WeightSource`'s parameter list, read as vLLM 0.33 reads it (`source.metadata`, an attribute)
    and as 0.32 does (`source.metadata()`, a call that returns the same list)."""

    def __call__(self) -> Metadata:
        return self


def learner_source(learner, dtype: torch.dtype):
    """A vLLM `WeightSource` over the learner: HF names and full shapes declared without gathering,
    then the same tensors, in the same order, from `Learner.hf_weights` (`iter_full`).

    Written to the current contract (vLLM 0.33: `metadata` a `functools.cached_property`, `iter_full`
    the full-tensor pass); `Metadata.__call__` and `__iter__` are how the pinned 0.32 reads the same
    two channels. tests/rollout/test_vllm_contract.py drives it through the installed vLLM's trainer engine."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class LearnerSource(WeightSource):
        @cached_property
        def metadata(self) -> Metadata:
            return Metadata(ParamMeta(name, dtype, tuple(shape)) for name, shape in learner.hf_shapes())

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            return after_default_stream(learner.hf_weights(dtype))

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self.iter_full()

    return LearnerSource()


def after_default_stream(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each one gathered after the default stream's work: vLLM's packed broadcast draws
    the source under CUDA streams of its own (one per buffer), and nothing else orders those gathers
    after `optimizer.step()`, which updates the shards on the default stream."""
    items = iter(weights)
    while True:
        if torch.cuda.is_available():
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
        try:
            item = next(items)
        except StopIteration:
            return
        yield item


def trainer_init_info(address: str, port: int, world_size: int, rank: int):
    """vLLM's init info of this learner rank: rank 0 opens the transfer group at `address:port`, of
    `world_size` ranks (rank 0 and every server's workers); packed buffers of `PACKED_BUFFER_BYTES`."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        master_address=address,
        master_port=port,
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=PACKED_BUFFER_BYTES,
        rank=rank,
    )


class NcclWeightTransport(WeightTransport):
    """vLLM's NCCL weight-transfer engine (GPUs only). A collective to build: every rank calls it."""

    def __init__(
        self,
        rank,
        sync_every,
        dtype,
        swap,
        learner,
        servers: list[EngineServer] | None,
        address: str = "",
        rendezvous_timeout_s: float = 60.0,
    ):
        super().__init__(rank, sync_every, dtype, swap)
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.client = None
        world_sizes = [s.world_size() for s in servers] if servers else []
        address = rendezvous_address(servers or [], address)
        if rank == 0:  # the servers must reach rank 0, or NCCL's rendezvous waits without a word
            check_rendezvous(servers, address, rendezvous_timeout_s)
        info = trainer_init_info(address, free_port() if rank == 0 else 0, 1 + sum(world_sizes), rank)
        if rank == 0:
            self.client = FanOutClient(servers, world_sizes)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=learner_source(learner, dtype)
        )

    def _send(self, learner) -> int:
        if self.swap is None:
            self.engine.send_weights()  # this rank's part of every gather
            return 0
        self.swap(lambda servers: self.engine.send_weights(), learner.version)
        return sum(torch.Size(shape).numel() for _, shape in learner.hf_shapes()) * self.dtype.itemsize

    def close(self) -> None:
        if self.client is not None:  # attached servers outlive the run: release their side too
            try:
                self.client.shutdown_weight_transfer_engine()
            except EngineError:
                pass
            self.client.close()
        self.engine.shutdown()


LOOPBACK_URLS = ("http://127.", "http://localhost", "http://[::1]")


def rendezvous_address(servers: list[EngineServer], address: str = "") -> str:
    """The address the servers reach the learner's rank 0 at (`rollout.transport_address` when
    given): loopback when they all run here, else this host's address, which must not be loopback."""
    remote = [s.url for s in servers if not s.url.startswith(LOOPBACK_URLS)]
    if not address:
        address = socket.gethostbyname(socket.gethostname()) if remote else "127.0.0.1"
        name = f"this host's name ({socket.gethostname()}) resolves to {address}"
    else:
        name = f"rollout.transport_address {address}"
    if remote and (address.startswith("127.") or address in ("localhost", "::1")):
        raise EngineError(
            f"{name}, a loopback address the engines on other hosts ({', '.join(remote)}) cannot reach: "
            "set rollout.transport_address to an address of this host on their network"
        )
    return address


def check_rendezvous(servers: list[EngineServer], address: str, timeout_s: float) -> None:
    """Before the first sync: each server's engine opens a connection to `address`, where learner rank
    0 listens, within `timeout_s`. An engine that cannot stops the run here, named with the reason,
    instead of a NCCL rendezvous that waits for it until the collective timeout."""
    with socket.create_server(("", 0), backlog=max(8, len(servers))) as listener:
        port = listener.getsockname()[1]
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            answers = list(
                pool.map(
                    lambda s: s.collective_rpc("m2po_reach", address, str(port), str(timeout_s)), servers
                )
            )
    failed = [f"{s.url} ({why})" for s, why in zip(servers, answers, strict=True) if why]
    if failed:
        raise EngineError(
            f"rollout server(s) {', '.join(failed)} could not reach the weight transport's rendezvous at "
            f"{address} within {timeout_s:g} s: set rollout.transport_address to an address of learner "
            "rank 0 that every engine host can reach"
        )
