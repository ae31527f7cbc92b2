"""The weight sync's deadline: a sync blocked on a dead or silent engine ends the run, naming it.

The "sync" here is a call blocked on an event, as rank 0 is in a NCCL broadcast; the engines are real
processes (a dead one is SIGKILLed) behind URLs where nothing answers; `abort` records its line and
frees the sync, where the run's own abort would stop the engines and exit."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from m2po_cli.rollout import deadline
from m2po_cli.rollout.deadline import SyncWatch
from m2po_cli.rollout.launch import free_port
from m2po_cli.rollout.nccl import after_default_stream
from m2po_cli.rollout.server import EngineServer


@pytest.fixture
def engines():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    servers = [EngineServer(f"http://127.0.0.1:{free_port()}", p) for p in procs]
    yield servers
    for p in procs:
        p.kill()
        p.wait()


def blocked_sync(watch: SyncWatch, version: int, lines: list[str], during=None, ends_after_s=None) -> float:
    """Run a sync that blocks until the watch aborts (or `ends_after_s` pass); `during()` runs once it
    has started. Returns the seconds it took."""
    freed = threading.Event()
    watch.abort = lambda line: (lines.append(line), freed.set())
    t0 = time.monotonic()
    with watch.watching(version):
        if during is not None:
            during()
        freed.wait(ends_after_s if ends_after_s is not None else 60)
    return time.monotonic() - t0


def test_an_engine_killed_during_a_sync_is_named_within_the_grace(engines, monkeypatch):
    monkeypatch.setattr(deadline, "GRACE_S", 1.0)
    lines: list[str] = []
    watch = SyncWatch(engines, timeout_s=300, abort=None)
    took = blocked_sync(watch, 7, lines, during=lambda: engines[1].proc.send_signal(signal.SIGKILL))
    assert len(lines) == 1 and took < 5, (lines, took)
    pid = engines[1].proc.pid
    assert f"(vllm serve, pid {pid}) exited with code -9" in lines[0], lines[0]
    assert lines[0].endswith("during the weight sync to version 7"), lines[0]


def test_a_sync_past_its_deadline_names_the_servers_that_no_longer_answer(engines, monkeypatch):
    monkeypatch.setattr(deadline, "GRACE_S", 0.5)
    monkeypatch.setattr(deadline, "HEALTH_S", 0.5)
    lines: list[str] = []
    watch = SyncWatch(engines, timeout_s=1.0, abort=None)
    took = blocked_sync(watch, 3, lines)
    assert len(lines) == 1 and 1.0 <= took < 6, (lines, took)
    urls = ", ".join(s.url for s in engines)
    assert lines[0] == (
        f"rollout server(s) {urls} stopped answering (no /health within 0.5 s): the weight sync to "
        "version 3 did not end within 1 s (rollout.sync_timeout_s)"
    )


def test_a_sync_that_fails_on_its_own_after_an_engine_dies_is_left_to_fail(engines, monkeypatch):
    # Over HTTP the dead engine's call fails with its name: the watch lets that error stand.
    monkeypatch.setattr(deadline, "GRACE_S", 3.0)
    lines: list[str] = []
    watch = SyncWatch(engines, timeout_s=300, abort=None)
    blocked_sync(watch, 1, lines, during=lambda: engines[0].proc.kill(), ends_after_s=1.5)
    assert lines == []


def test_a_sync_that_ends_in_time_is_not_touched(engines):
    lines: list[str] = []
    watch = SyncWatch(engines, timeout_s=2.0, abort=None)
    took = blocked_sync(watch, 1, lines, ends_after_s=0.7)
    assert lines == [] and took < 1.5


def test_every_gather_of_a_nccl_push_waits_for_the_default_stream(monkeypatch):
    """vLLM draws the source under its own CUDA streams: before each tensor is gathered, the current
    stream must wait for the default one (where optimizer.step() ran). Enforced here without a GPU."""
    events: list[str] = []

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            events.append(f"{self.name} waits {other.name}")

    current = Stream("vllm-0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: Stream("default"))

    def gathered():
        for name in ("embed", "layer", "head"):
            events.append(f"gather {name} on {current.name}")
            yield name, torch.zeros(1)

    for i, _ in enumerate(after_default_stream(gathered())):
        current = Stream(f"vllm-{(i + 1) % 2}")  # packed buffers alternate streams
    assert events == [
        "vllm-0 waits default", "gather embed on vllm-0",
        "vllm-1 waits default", "gather layer on vllm-1",
        "vllm-0 waits default", "gather head on vllm-0",
        "vllm-1 waits default",
    ]  # fmt: skip
