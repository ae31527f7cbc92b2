"""The one grader: training rewards and evaluation scores both come from here.

A response scores 1.0 when the content of its last `\\boxed{...}` is equivalent to the gold answer
(`answers.grade`: the paper's rule under math-verify), and 0.0 otherwise (no box, unparsable, wrong,
too slow).

Time limits. sympy can take minutes on adversarial answers (`9^{9^{9^{9}}}`, `100000000!`), so
`Grader` grades in worker processes with two limits per sample:
- soft: the worker arms `SIGALRM` (`setitimer`, `timeout_s`) around each sample and the handler
  raises `_Deadline`, a `BaseException` that math-verify's `except Exception` cannot swallow. One
  budget covers parsing both sides and every comparison. math-verify's own signal timeouts are
  switched off (whole seconds only, one per parse/comparison, and they would reset our timer).
- hard: the parent kills a worker that has not reported a sample within `2 * timeout_s` (a hang in
  C code, where Python signal handlers never run) and starts a fresh one.
Either way the sample scores 0.0 and the rest of its chunk is graded normally.

A recipe's own reward (`reward.function = "package.module:name"`) runs in the same pool under the
same two limits, one group per call (`score_groups`): name(prompt, completions, answer, **columns)
returns one number per completion. A group that runs out of time scores 0.0; a function that raises
or returns anything but one finite number per completion stops the run (`RewardError`, one line).
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection, wait
from types import FrameType
from typing import Any

from m2po_cli.answers import answers_match, extract_boxed
from m2po_cli.data import Problem
from m2po_cli.errors import RunError, first_line

_WORKER_START_S = 300.0  # spawn + importing sympy can be slow on a loaded machine


def grader_workers(grading_ranks: int) -> int:
    """Grading processes for each of the `grading_ranks` ranks that grade on this host during
    training: 4, or fewer where they would otherwise start more than the host has cores (each
    worker imports sympy: a few seconds and ~200 MB)."""
    return max(1, min(4, (os.cpu_count() or 1) // grading_ranks))


def recipe_grader(recipe, num_workers: int) -> Grader:
    """The grader a training run scores with: `reward.function` or the math grader, its time limit."""
    return Grader(num_workers=num_workers, timeout_s=recipe.reward.timeout_s, reward=recipe.reward.function)


class GraderError(Exception):
    """The grading pool cannot run at all (a worker died before it was ready)."""


class RewardError(RunError):
    """`reward.function` cannot be loaded, raised, or returned something other than the scores."""


def load_reward(spec: str) -> Callable[..., Any]:
    """The callable `package.module:name` names (`reward.function`); a RewardError in one line."""
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except Exception as e:  # an import runs arbitrary code: any failure is the function's
        raise RewardError(
            f"reward.function: cannot load {spec!r}: {type(e).__name__}: {first_line(e)}"
        ) from None
    if not callable(function):
        raise RewardError(f"reward.function: {spec!r} is a {type(function).__name__}, not a callable")
    return function


def _checked_scores(values: Any, n: int) -> list[float] | str:
    """`values` as n floats, or what is wrong with them."""
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        return f"returned a {type(values).__name__}, not one number per completion"
    if len(values) != n:
        return f"returned {len(values)} values for {n} completions"
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            return f"returned {v!r}, not a finite number"
    return [float(v) for v in values]


def _reward_within(
    function: Callable[..., Any], group: tuple, timeout_s: float
) -> tuple[list[float] | str, bool]:
    """(scores or what went wrong, timed_out) of one group. Needs `_on_alarm` for SIGALRM."""
    prompt, completions, answer, columns = group
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            values = function(prompt, list(completions), answer, **columns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return [0.0] * len(completions), True
    except Exception as e:
        return f"raised {type(e).__name__}: {first_line(e)}", False
    return _checked_scores(values, len(completions)), False


def _grade_pair(pair: tuple[str, str], timeout_s: float) -> tuple[float, bool]:
    return _grade_within(*pair, timeout_s)


def _task(function: Callable[..., Any] | None) -> Callable[[Any, float], tuple[Any, bool]]:
    """What scores one item within a time limit: a (prediction, gold) pair by the math grader, or a
    group by `function`. Returns (score, timed_out)."""
    return _grade_pair if function is None else partial(_reward_within, function)


# --- time-limited grading (runs in the worker's main thread, or in-process) ----------------------


class _Deadline(BaseException):
    """Raised by SIGALRM; a BaseException so math-verify's `except Exception` lets it through."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Deadline


def _grade_within(pred: str, gold: str, timeout_s: float) -> tuple[float, bool]:
    """(score, timed_out). Needs `_on_alarm` installed for SIGALRM (main thread only)."""
    # The outer try also catches an alarm that fires inside the `finally`, just before disarming.
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return float(answers_match(pred, gold)), False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return 0.0, True


def _drop_timeout_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


# math-verify warns once per process that its own timeouts are off: `Grader`'s limits replace them.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_warning)


def worker_main(conn: Connection, reward: str = "") -> None:
    """Worker loop: receive `(items, timeout_s)`, send `(score, timed_out)` per item, in order. An
    item is a (prediction, gold) pair for the math grader, a group for `reward`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    if not reward:
        answers_match("1", "1")  # import sympy and the LaTeX parser before reporting ready
    task = _task(load_reward(reward) if reward else None)
    try:
        conn.send("ready")
    except BrokenPipeError:  # the pool was closed while this worker was still starting
        return
    while True:
        try:
            pairs, timeout_s = conn.recv()
        except (EOFError, ConnectionResetError):
            # The parent closed the pipe or died; a reset when it closed with our "ready" unread
            # (a pool that never got a sample to grade).
            return
        for item in pairs:
            conn.send(task(item, timeout_s))


# --- the pool ------------------------------------------------------------------------------------


@dataclass
class _Worker:
    """One grading process and the chunk it is working on (sample indices into the batch)."""

    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    chunk: deque[int] = field(default_factory=deque)
    deadline: float = 0.0  # monotonic time by which it must answer (start-up or current sample)


class Grader:
    """Batch grader with a per-sample time limit; one persistent pool of spawned processes.

    `grade_many` never hangs and never raises for a bad sample: a sample that times out, or whose
    worker crashes, scores 0.0 and the pool replaces the worker. Samples go to workers in chunks of
    `chunk_size` (one pipe message per chunk), but each sample reports back on its own, so the
    deadline is per sample and one pathological answer cannot zero its chunk. Workers are
    spawned, never forked: the parent holds torch and a vLLM engine. `num_workers=0` grades
    in-process with only the soft limit (main thread only; for tests and tiny runs).
    Counters over the grader's life: `num_timeouts`, samples scored 0.0 because they ran out of
    time or took their worker down with them; `num_restarts`, workers replaced.
    """

    def __init__(self, num_workers: int = 4, timeout_s: float = 5.0, chunk_size: int = 32, reward: str = ""):
        if num_workers < 0 or timeout_s <= 0 or chunk_size < 1:
            raise ValueError(f"Grader: bad arguments {num_workers=}, {timeout_s=}, {chunk_size=}")
        self.num_workers, self.timeout_s, self.chunk_size = num_workers, timeout_s, chunk_size
        self.reward = reward  # `reward.function`, or "" for the math grader
        self._function = load_reward(reward) if reward else None  # fails here, before any worker
        # Twice the soft limit: a worker that is merely slow to report its own timeout is not killed.
        self._kill_after_s = 2 * timeout_s
        self.num_timeouts = self.num_restarts = 0
        self._closed = False
        self._ctx = mp.get_context("spawn")
        self._workers = [self._start_worker() for _ in range(num_workers)]

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; idempotent."""
        for w in self._workers:
            w.conn.close()  # an idle worker exits on EOF
        for w in self._workers:
            w.process.join(timeout=2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        self._workers = []
        self._closed = True

    def grade_many(self, responses: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Score each response against its gold (1.0 / 0.0), in order."""
        if len(responses) != len(golds):
            raise ValueError(f"grade_many: {len(responses)} responses but {len(golds)} golds")
        if self._closed:
            raise GraderError("grade_many: the grader is closed")
        preds = [extract_boxed(r) for r in responses]
        scores = [0.0] * len(responses)
        todo = [i for i, p in enumerate(preds) if p is not None]
        self._score(_task(None), list(zip(preds, golds, strict=True)), todo, scores, self.chunk_size)
        return scores

    def score_groups(self, problems: Sequence[Problem], groups: Sequence[Sequence[str]]) -> list[list[float]]:
        """The reward of every response of each problem's group: `reward.function`'s when the
        grader has one, else the math grader's against the problem's answer."""
        if len(problems) != len(groups):
            raise ValueError(f"score_groups: {len(problems)} problems but {len(groups)} groups")
        if self._function is None:
            flat = self.grade_many(
                [t for g in groups for t in g],
                [p.answer for p, g in zip(problems, groups, strict=True) for _ in g],
            )
            scores = iter(flat)
            return [[next(scores) for _ in g] for g in groups]
        if self._closed:
            raise GraderError("score_groups: the grader is closed")
        items = [(p.problem, list(g), p.answer, p.columns) for p, g in zip(problems, groups, strict=True)]
        results: list[Any] = [[0.0] * len(g) for g in groups]  # a group that times out keeps these
        per_chunk = max(1, self.chunk_size // 8)  # a group is about 8 samples
        self._score(_task(self._function), items, list(range(len(items))), results, per_chunk)
        for problem, result in zip(problems, results, strict=True):
            if isinstance(result, str):
                raise RewardError(
                    f"reward.function {self.reward}: {result} (problem {problem.index}: {problem.problem[:60]!r})"
                )
        return results

    def _score(self, task, items: list[Any], todo: list[int], scores: list[Any], per_chunk: int) -> None:
        """`scores[i]` for each i in `todo`: `task(items[i])` in the pool, in chunks of `per_chunk`
        (the workers run the same task), or here with the soft limit only when there is no pool."""
        if self.num_workers == 0:
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            try:
                for i in todo:
                    scores[i], timed_out = task(items[i], self.timeout_s)
                    self.num_timeouts += timed_out
            finally:
                signal.signal(signal.SIGALRM, previous)
            return
        chunks = deque(deque(todo[i : i + per_chunk]) for i in range(0, len(todo), per_chunk))
        try:
            self._run(chunks, items, scores)
        except BaseException:
            # Interrupted mid-batch (Ctrl-C): busy workers would send stale scores to the next call.
            self.close()
            raise

    def _run(self, chunks: deque[deque[int]], pairs: list[Any], scores: list[Any]) -> None:
        """Feed chunks to ready workers until every item (sample or group) has a score."""
        while chunks or any(w.chunk for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and not w.chunk and chunks:
                    w.chunk = chunks.popleft()
                    w.deadline = now + self._kill_after_s
                    try:
                        w.conn.send(([pairs[i] for i in w.chunk], self.timeout_s))
                    except OSError:  # it died while idle: nothing was graded, `_drain` replaces it
                        chunks.appendleft(w.chunk)
                        w.chunk = deque()
            # No deadline to wait for when the only worker just died idle: `_drain` replaces it now.
            deadlines = [w.deadline for w in self._workers if w.chunk or not w.ready]
            wait_s = max(0.0, min(deadlines, default=now) - now)
            wait([w.conn for w in self._workers], timeout=wait_s)
            for k, w in enumerate(self._workers):
                if not self._drain(w, scores):
                    self._workers[k] = self._replace(w, chunks)

    def _drain(self, w: _Worker, scores: list[float]) -> bool:
        """Read every message `w` has sent; False if it died or ran past its deadline."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg == "ready":
                    w.ready = True
                else:
                    scores[w.chunk.popleft()], timed_out = msg
                    self.num_timeouts += timed_out
                w.deadline = time.monotonic() + self._kill_after_s
        except (EOFError, OSError):
            return False
        busy_or_starting = w.chunk or not w.ready
        return not (busy_or_starting and time.monotonic() > w.deadline)

    def _replace(self, w: _Worker, chunks: deque[deque[int]]) -> _Worker:
        """Kill `w`; its current sample keeps its 0.0, the rest of its chunk goes back in the queue."""
        if not w.ready:
            w.process.kill()
            w.process.join()
            raise GraderError(
                f"a grader worker did not start within {_WORKER_START_S:.0f} s or died while starting "
                f"(exit code {w.process.exitcode}); its traceback, if any, is in the log above"
            )
        w.process.kill()
        w.process.join()
        w.conn.close()
        if w.chunk:
            w.chunk.popleft()  # the sample it was stuck on
            self.num_timeouts += 1
            if w.chunk:
                chunks.appendleft(w.chunk)
        self.num_restarts += 1
        return self._start_worker()

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=worker_main, args=(child_conn, self.reward), daemon=True, name="m2po-grader"
        )
        process.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        return _Worker(process, parent_conn, deadline=time.monotonic() + _WORKER_START_S)
