"""A deadline on every weight sync of separate mode: the sync ends, or the run does, naming the engine.

A sync is a collective with the engines. Under the NCCL transport learner rank 0 waits for the
broadcast in a CUDA stream synchronize, which no Python exception or signal handler interrupts, and
the other ranks wait in their next gather; an engine that dies there would hold the run until the
collective timeout (an hour by default) and the error would then name NCCL. So a watch runs beside
each sync on rank 0: when an engine this run started exits, or the sync outlasts
`rollout.sync_timeout_s`, and the sync has not ended on its own `GRACE_S` later (over HTTP a dead
engine already fails the call, with its name), the watch ends the run itself (`abort`): one line
naming the engine, every engine stopped, the process gone, and torchrun stopping the other ranks.
The run resumes from its last checkpoint like any other killed run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from m2po_cli.rollout.server import EngineServer

POLL_S = 0.5  # how often the watch looks at the engines' processes
GRACE_S = 5.0  # how long a sync may take to fail on its own once an engine is gone
HEALTH_S = 5.0  # how long a server has to answer /health when a sync outlasts its deadline


class SyncWatch:
    """`watching(version)` around each sync; `abort(line)` ends the run when the watch must."""

    def __init__(self, servers: list[EngineServer], timeout_s: float, abort: Callable[[str], None]):
        self.servers, self.timeout_s, self.abort = servers, timeout_s, abort

    @contextmanager
    def watching(self, version: int) -> Iterator[None]:
        done = threading.Event()
        watch = threading.Thread(target=self._watch, args=(done, version), name="sync-watch", daemon=True)
        watch.start()
        try:
            yield
        finally:
            done.set()
            watch.join()

    def _watch(self, done: threading.Event, version: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(POLL_S):
            gone = [why for s in self.servers if (why := s.exited())]
            if gone:
                reason = f"{gone[0]} during the weight sync to version {version}"
            elif time.monotonic() > deadline:
                reason = self._overdue(version)
            else:
                continue
            if not done.wait(GRACE_S):
                self.abort(reason)
            return

    def _overdue(self, version: int) -> str:
        """The line for a sync past its deadline: the servers that no longer answer, else all of them."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            answers = list(pool.map(answers_health, self.servers))
        silent = [s.url for s, ok in zip(self.servers, answers, strict=True) if not ok]
        limit = f"did not end within {self.timeout_s:g} s (rollout.sync_timeout_s)"
        if silent:
            return (
                f"rollout server(s) {', '.join(silent)} stopped answering (no /health within {HEALTH_S:g} s): "
                f"the weight sync to version {version} {limit}"
            )
        named = ", ".join(s.url for s in self.servers)
        return (
            f"the weight sync to version {version} with rollout server(s) {named} {limit}; all answer /health"
        )


def answers_health(server: EngineServer) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=HEALTH_S).status_code == 200
    except httpx.HTTPError:
        return False
