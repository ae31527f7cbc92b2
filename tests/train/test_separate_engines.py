"""Separate mode with two real `vllm serve` engines: they start together, and one that dies or
freezes in the middle of a weight sync ends the run within the sync's deadline, named in one line,
with no process of the run left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from m2po_cli.rollout.transport import PREFIX, shm_root
from tests.train.test_separate import RECIPE, command, group_members, records, wait_for

pytestmark = pytest.mark.slow

SYNC_TIMEOUT_S = 20


def api_servers(pgid: int) -> list[psutil.Process]:
    return [p for p in group_members(pgid) if "api_server" in " ".join(p.cmdline())]


def port_of(server: psutil.Process) -> int:
    cmd = server.cmdline()
    return int(cmd[cmd.index("--port") + 1])


def start_windows(out: str) -> list[tuple[float, float]]:
    """Each engine's (spawned, answered /health) seconds, from the run's console line."""
    line = next(x for x in out.splitlines() if "engine(s) ready, from spawn to /health" in x)
    return [(float(a), float(b)) for a, b in re.findall(r"engine-\d+ ([\d.]+)-([\d.]+) s", line)]


def frozen_in_a_sync(run: subprocess.Popen, engine: psutil.Process) -> None:
    """SIGSTOP `engine` as a sync starts (its weights folder appears in shared memory), until a sync
    is seen stuck on it: the folder still there a second later (a sync takes ~0.1 s here)."""
    folder = next(shm_root().glob(f"{PREFIX}run-pid{run.pid}-*"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert run.poll() is None, f"the run exited early with code {run.returncode}"
        if not any(folder.glob("v*")):
            time.sleep(0.005)
            continue
        engine.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        if any(folder.glob("v*")):
            return
        engine.send_signal(signal.SIGCONT)  # the sync had ended before the stop: the next one
    raise AssertionError("no weight sync was caught on the stopped engine")


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_an_engine_lost_in_a_sync_ends_the_run_in_one_line_within_the_deadline(tmp_path, fault):
    extra = ("rollout.num_engines=2", f"rollout.sync_timeout_s={SYNC_TIMEOUT_S}", "run.steps=400")
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen(command(tmp_path, *extra), stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: records(tmp_path / "run", "trained_prompts.jsonl"), 900, run)
        (a0, b0), (a1, b1) = start_windows(log_path.read_text())
        assert a1 < b0 and a0 < b1, "the two engines did not load at the same time"
        servers = api_servers(run.pid)
        assert len(servers) == 2, "two vllm serve in the run's group"
        everything = [p for s in servers for p in (s, *s.children(recursive=True))]
        lost = max(servers, key=lambda p: p.pid)
        url = f"http://127.0.0.1:{port_of(lost)}"
        frozen_in_a_sync(run, lost)
        t0 = time.monotonic()
        if fault == "killed":
            lost.kill()
        run.wait(timeout=SYNC_TIMEOUT_S + 60)
        took = time.monotonic() - t0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    out = log_path.read_text()
    last = out.rstrip().splitlines()[-1]
    assert run.returncode == 2 and "Traceback" not in out, out[-3000:]
    if fault == "killed":  # the sync's own call to it fails, naming it, at once
        assert f"(vllm serve, pid {lost.pid}) exited with code -9" in last and took < 20, (last, took)
    else:  # nothing fails by itself: the watch ends the run past the deadline
        assert last.startswith(f"rollout server(s) {url} stopped answering"), last
        assert f"did not end within {SYNC_TIMEOUT_S} s (rollout.sync_timeout_s)" in last, last
        assert SYNC_TIMEOUT_S <= took < SYNC_TIMEOUT_S + 30, took
    _, alive = psutil.wait_procs(everything, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "an engine process outlived the run"
    _, left = psutil.wait_procs(group_members(run.pid), timeout=30)
    assert not left, f"processes of the run are still alive: {[' '.join(p.cmdline()) for p in left]}"
    assert not list(shm_root().glob(f"{PREFIX}*-pid{run.pid}-*")), "the run left its weights in shared memory"
