"""The rollout producer of separate mode: keeps the engines generating while the learner trains.

A background thread runs an asyncio loop that sends one generate request per prompt (its `n`
samples) to the servers, as many at a time as admission and each server's concurrency allow;
continuous batching in the engine does the rest. With an environment, each episode's later turns
follow on the same server, one request each (`episode.play_episodes`). A second thread settles
finished groups as they arrive (the caller's `settle`: grading and packing into tensors), off the
learner's critical path; settled groups wait in a buffer until the learner takes a step's worth.

Versions. A weight sync pauses the engines with `mode=keep`: requests in flight stay in the engine,
recompute their KV cache under the new weights and go on sampling, so nothing is thrown away. Each
token carries the version that sampled it (the server's weight-version spans); a group records the
engine version at submission, the oldest any of its tokens can have (with LoRA, `adapters`, a request
names its submission version's adapter, and all its tokens carry that version).

Bounded staleness. The learner takes groups in admission order, B prompts per optimizer update, so
the group admitted a-th is trained last by update `schedule.last_update(a)` = a // B (with `epochs`
passes over each step's P prompts, the mini-batch's update in the last pass; `m2po_cli.schedule`). A
new prompt is admitted at engine version v only while `last_update(admitted) <= v + max_staleness`:
its tokens, sampled at v or later, are trained within max_staleness updates of their own version, and
nothing is dropped. Admission order keeps the trained sample unbiased: a long response is trained in
its turn, not after the short ones that overtook it.

Failures. A started server that exits, a request unanswered in `request_timeout_s`, a learner waiting
that long for a group, and a run of unanswered requests stop the run in one line naming the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

import aiohttp

from m2po_cli.config import EnvConfig, RolloutConfig
from m2po_cli.data import Prompt, PromptBatches
from m2po_cli.errors import UserError
from m2po_cli.rollout.episode import Episode, Episodes, play_episodes
from m2po_cli.rollout.idle import IdleClock
from m2po_cli.rollout.payload import adapter_name, swap_adapter
from m2po_cli.rollout.server import (
    EXIT_GRACE_S,
    GENERATE,
    EngineError,
    EngineServer,
    Load,
    server_sampler,
    swap_weights,
)
from m2po_cli.rollout.settings import request_seed
from m2po_cli.rollout.types import Finished, Group, Request, Settle, Ticket
from m2po_cli.run_dir import GENERATED_TOKENS
from m2po_cli.schedule import Schedule

MAX_FAILURES = 8  # requests in a row that may get no answer before the run stops


class RolloutProducer:
    """Admission, streaming, settling and the finished-group buffer (rank 0 only)."""

    def __init__(
        self,
        servers: list[EngineServer],
        prompts: PromptBatches,
        cfg: RolloutConfig,
        schedule: Schedule,
        max_staleness: int,
        version: int,
        in_flight: list[Ticket | Group] = (),
        fresh: list[Ticket] = (),
        settle: Settle | None = None,
        run_seed: int = 0,
        episodes: Episodes | None = None,
        adapters: bool = False,
    ):
        self.servers, self.prompts, self.cfg, self.adapters = servers, prompts, cfg, adapters
        # The completions' text, decoded here rather than on the engines' side.
        self.decode = functools.partial(prompts.tokenizer.decode, skip_special_tokens=True)
        self.run_seed = run_seed  # with a request's admission index, its sampling seed
        self.schedule, self.max_staleness = schedule, max_staleness
        self.settle = settle
        self.episodes = episodes or Episodes(EnvConfig(), cfg.max_new_tokens, None, None)  # one turn
        self.per_server = max([1] + [2 * s.max_num_seqs // cfg.n for s in servers])  # keeps a batch full
        self.cond = threading.Condition()
        self.engine_version = version
        # The learner has consumed the groups of the steps before `version`; the carried ones were
        # admitted already, in order: prompts to (re)generate, or groups a checkpoint kept settled.
        self.consumed = schedule.step_start(version)
        carried = list(enumerate(in_flight, start=self.consumed))
        self.resubmit: deque[tuple[int, Ticket]] = deque((i, t) for i, t in carried if isinstance(t, Ticket))
        self.admitted = self.consumed + len(carried)
        self.fresh: deque[Ticket] = deque(fresh)  # pulled from the data, not admitted yet
        self.running: dict[int, tuple[int, Ticket, str]] = {}  # requests in flight by key: index, prompt, URL
        self.load = {s.url: 0 for s in servers}  # requests in flight per server
        self.servers_by_url = {s.url: s for s in servers}
        self.finished: list[tuple[Finished, int]] = []  # answered, waiting to be settled (with index)
        self.settling: list[tuple[Finished, int]] = []  # being settled now
        self.done = {i: replace(g, index=i) for i, g in carried if isinstance(g, Group)}  # by admission index
        self.syncing = self.stopping = False
        self.error: BaseException | None = None
        self._next_key = self._failures = 0
        self._last_progress = time.monotonic()
        self._t_metrics = time.perf_counter()  # counters since the last `take_metrics()`:
        self.idle = IdleClock()
        self._learner_wait_s, self._num_samples, self._num_tokens, self._regenerated = 0.0, 0, 0, 0
        self._loop: asyncio.AbstractEventLoop | None = None  # the request loop, once it runs
        self._admission: asyncio.Event | None = None
        self.threads = [
            threading.Thread(target=lambda: asyncio.run(self._main()), name="rollouts", daemon=True),
            threading.Thread(target=self._settle_loop, name="settle", daemon=True),
        ]

    # --- the learner's side -----------------------------------------------------------------------

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def ready(self, num_groups: int) -> bool:
        """Whether the next `num_groups` groups in admission order have all been settled."""
        with self.cond:
            return all(i in self.done for i in range(self.consumed, self.consumed + num_groups))

    def take(self, num_groups: int, learner_version: int) -> list[Group]:
        """The next `num_groups` groups in admission order, blocking until all have been settled."""
        t0 = time.perf_counter()
        with self.cond:
            while not self.ready(num_groups) and self.error is None:
                self.cond.wait(timeout=1.0)
                self._check_progress()
            if self.error is not None:
                raise EngineError(f"rollouts stopped: {self.error}") from self.error
            taken = [self.done.pop(i) for i in range(self.consumed, self.consumed + num_groups)]
            self.consumed += num_groups
            self._learner_wait_s += time.perf_counter() - t0
            self.cond.notify_all()
        first = self.consumed - num_groups  # trained first at learner_version
        for j, g in enumerate(taken):
            later = self.schedule.last_update(first + j) - self.schedule.first_update(first)
            staleness = learner_version + later - g.version
            assert 0 <= staleness <= self.max_staleness, f"admission let staleness reach {staleness}"
        return taken

    def _check_progress(self, grace_s: float = 0.0) -> None:
        """Under the lock: stop the run if a started server died (waiting `grace_s` for one that is
        exiting) or nothing finished for too long."""
        for s in self.servers:
            if (why := s.exited(grace_s)) is not None:
                self.error = EngineError(why)
        waited = time.monotonic() - self._last_progress
        if self.error is None and self.running and waited > self.cfg.request_timeout_s:
            urls = sorted({url for _, _, url in self.running.values()})
            self.error = EngineError(
                f"no rollout request finished in {waited:.0f} s (rollout.request_timeout_s) with "
                f"{len(self.running)} in flight on {', '.join(urls)}: the server hangs or is far too slow"
            )

    def swap(self, load: Load, version: int) -> None:
        """Load new weights into every engine with `load(servers)` (the weight transport's rank-0 side);
        requests in flight go on under the new weights (with adapters: under the one they named)."""
        with self.cond:
            self.syncing = True
            self._update_idle()
        try:
            (swap_adapter if self.adapters else swap_weights)(self.servers, load, version)
        finally:
            with self.cond:
                self.engine_version, self.syncing = version, False
                self._update_idle()
                self.cond.notify_all()
            self._wake_admission()

    def snapshot(self) -> dict:
        """What a checkpoint needs to lose no prompt: admitted-but-untrained ones and pulled ones, as
        [epoch, problem index] pairs (plain ints: the loop state loads with `weights_only=True`)."""
        with self.cond:
            untrained = (
                list(self.resubmit)
                + [(index, ticket) for index, ticket, _ in self.running.values()]
                + [(index, f.ticket) for f, index in self.settling + self.finished]
                + [(g.index, (g.epoch, g.prompt)) for g in self.done.values()]
            )
            in_flight = [ticket for _, ticket in sorted(untrained, key=lambda x: x[0])]
            return {
                "data": self.prompts.state_dict(),
                "in_flight": [[epoch, p.problem.index] for epoch, p in in_flight],
                "fresh": [[epoch, p.problem.index] for epoch, p in self.fresh],
            }

    def take_metrics(self) -> dict[str, float]:
        now = time.perf_counter()
        with self.cond:
            wall = max(now - self._t_metrics, 1e-9)
            idle = {why: seconds / wall for why, seconds in self.idle.take(now).items()}
            m = {
                "perf/engine_idle_frac": min(1.0, sum(idle.values())),
                **{f"perf/engine_idle_{why}_frac": min(1.0, frac) for why, frac in idle.items()},
                "perf/learner_idle_frac": min(1.0, self._learner_wait_s / wall),
                "perf/samples_per_s": self._num_samples / wall,
                GENERATED_TOKENS: float(self._num_tokens),
                "rollout/in_flight": float(len(self.running)),
                "rollout/buffered": float(len(self.done)),
                "rollout/regenerated": float(self._regenerated),
            }
            self._t_metrics = now
            self._learner_wait_s, self._num_samples, self._num_tokens, self._regenerated = 0.0, 0, 0, 0
        return m

    def _wake_admission(self) -> None:
        """Tell the request loop (from any thread) that admission may have opened."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                self._loop.call_soon_threadsafe(self._admission.set)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._wake_admission()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout=30)

    # --- the threads' side ------------------------------------------------------------------------

    def admit(self) -> Request | None:
        """The next request to send, to the least loaded server, or None if none may go now."""
        with self.cond:
            if self.syncing or self.stopping:
                return None
            url = min(self.load, key=self.load.get) if self.load else ""
            if self.load and self.load[url] >= self.per_server:
                return None
            if not self.resubmit:
                if self.bound_reached():
                    return None
                if not self.fresh:
                    batch = next(self.prompts)  # a batch never straddles two epochs
                    self.fresh.extend(Ticket(self.prompts.epoch, p) for p in batch)
                self.resubmit.append((self.admitted, self.fresh.popleft()))
                self.admitted += 1
            index, ticket = self.resubmit.popleft()
            key, self._next_key = self._next_key, self._next_key + 1
            if not self.running:
                self._last_progress = time.monotonic()
            self.running[key] = (index, ticket, url)
            self._update_idle()
            if url:
                self.load[url] += 1
            return Request(key, ticket, self.engine_version, url)

    async def _main(self) -> None:
        # aiohttp: its C HTTP parser and connection pool cost the learner's host a fraction of what
        # a pure-Python client does per request (tens of requests a second at the CPU quickstart).
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=10.0)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            tasks: set[asyncio.Task] = set()
            self._loop, self._admission = asyncio.get_running_loop(), asyncio.Event()
            while not self.stopping and self.error is None:
                self._admission.clear()  # before `admit`: a wake-up after it is not lost
                request = self.admit()
                if request is None:  # until a request finishes or a sync ends (or a second passes)
                    with self.cond:
                        self._check_progress()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._admission.wait(), timeout=1.0)
                    continue
                task = asyncio.create_task(self._request(http, *request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, http: aiohttp.ClientSession, key: int, ticket: Ticket, version: int, url: str):
        with self.cond:
            index = self.running[key][0]
        seed = request_seed(self.run_seed, index)  # a resubmitted prompt samples what it would have
        try:
            episodes = await self._episodes(http, url, ticket.prompt, seed, version)
        except UserError as e:  # a server's error, or an environment's
            self._fail(e)
            return
        except aiohttp.ClientError as e:
            if not self._no_answer(url, e):
                return
            episodes = None
        except Exception as e:  # noqa: BLE001 (an episode that breaks its invariants stops the run)
            self._fail(
                EngineError(
                    f"an episode of problem {ticket.prompt.problem.index} failed: {type(e).__name__}: {e}"
                )
            )
            return
        self.finish(key, ticket, version, episodes)

    async def _episodes(self, http, url: str, prompt: Prompt, seed: int, v: int) -> list[Episode] | None:
        """The `n` episodes of `prompt`, every turn from the server at `url`, whose prefix cache holds
        the episode (`episode.play_episodes`); None if the engine aborted a request. A turn sent while
        a weight swap pauses the server waits in it; with adapters, every turn names version `v`'s."""
        echo = self.episodes.multi_turn  # the server repeats the tokens it was given, to check
        model, fixed = (adapter_name(v), v) if self.adapters else (self.servers_by_url[url].model_name, None)
        sample = server_sampler(http, url, model, self.cfg, self.decode, echo, self._answered, fixed)
        return await play_episodes(sample, self.episodes, prompt, seed)

    def _answered(self) -> None:
        self._last_progress = time.monotonic()  # a turn's answer is progress, before its group ends

    def _no_answer(self, url: str, e: aiohttp.ClientError) -> bool:
        """A request failed without an answer: whether to send it again. A kept-alive connection the
        server has just closed (it drops idle ones after a few seconds) fails a request so; only a run
        of failures (a dead or unreachable server) stops the run."""
        with self.cond:
            self._check_progress()  # a dead server says so, not "no answer"
            self._failures += 1
            if self.error is None and self._failures > MAX_FAILURES:
                self._check_progress(grace_s=EXIT_GRACE_S)  # a killed server may still be exiting
            if self.error is None and self._failures > MAX_FAILURES:
                self.error = EngineError(
                    f"{url}{GENERATE}: {self._failures} requests in a row got no answer "
                    f"(last: {type(e).__name__}: {e})"
                )
            if self.error is not None:
                self.cond.notify_all()
            return self.error is None

    def bound_reached(self) -> bool:
        """Whether the staleness bound holds admission: one more prompt could not be trained within
        `max_staleness` updates of the engine's version (the learner takes prompts in order)."""
        return self.schedule.last_update(self.admitted) > self.engine_version + self.max_staleness

    def _update_idle(self) -> None:
        """Under the lock, after a change of what is in flight or of a sync: why the engines idle, if they do."""
        held = not self.resubmit and self.bound_reached()
        self.idle.now("sync" if self.syncing else None if self.running else "bound" if held else "starved")

    def _fail(self, error: UserError) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def finish(self, key: int, ticket: Ticket, version: int, episodes: list[Episode] | None) -> None:
        """Request `key` (submitted at engine `version`) came back: its `episodes` go to be settled, or,
        with no answer (aborted outside the run, or a dropped connection), it is submitted again."""
        self._wake_admission()
        with self.cond:
            index, _, url = self.running.pop(key)
            if url:
                self.load[url] -= 1
            self._last_progress = time.monotonic()
            self._update_idle()
            if episodes is None:
                self.resubmit.appendleft((index, ticket))  # it keeps its place in the order
                self._regenerated += 1
                return
            self._failures = 0
            versions = {v for e in episodes for c in e.turns for v in (c.versions or [version])}
            if min(versions) < version or max(versions) > self.engine_version:
                self.error = EngineError(
                    f"{url}: tokens of a request submitted at weight version {version} carry versions "
                    f"{sorted(versions)} (the run is at {self.engine_version}): another trainer may be "
                    "updating this server; give this run its own"
                )
                self.cond.notify_all()
                return
            self.finished.append((Finished(ticket, version, episodes), index))
            self._num_samples += len(episodes)
            self._num_tokens += sum(len(c.token_ids) for e in episodes for c in e.turns)
            if self.settle is None:
                self._settled(self.finished, [f.episodes for f, _ in self.finished])
                self.finished = []
            self.cond.notify_all()

    def _settle_loop(self) -> None:
        while True:
            with self.cond:
                while not self.finished and not self.stopping and self.error is None:
                    self.cond.wait(timeout=1.0)
                if self.stopping or self.error is not None:
                    return
                self.settling, self.finished = self.finished, []
            try:
                rows = self.settle([f for f, _ in self.settling])
            except Exception as e:  # noqa: BLE001 (any failure stops the run, with its message)
                self._fail(EngineError(f"settling finished rollouts failed: {type(e).__name__}: {e}"))
                return
            with self.cond:
                self._settled(self.settling, rows)
                self.settling = []
                self.cond.notify_all()

    def _settled(self, finished: list[tuple[Finished, int]], rows: list[Any]) -> None:
        for (f, index), r in zip(finished, rows, strict=True):
            self.done[index] = Group(f.ticket.epoch, f.ticket.prompt, r, f.version, index)
