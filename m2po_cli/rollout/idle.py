"""Where separate mode's engines spend the time they do not generate, clocked by the producer."""

from __future__ import annotations

import time


class IdleClock:
    """Seconds the engines spent idle since the last `take`, by why:
    - `sync`: paused for a weight swap (requests in flight wait; admission too);
    - `bound`: nothing in flight, because the staleness bound holds admission until the next swap;
    - `starved`: nothing in flight for another reason (between a request's answer and the next
      admission, or the run not yet asking)."""

    def __init__(self) -> None:
        self.why: str | None = "starved"  # before the first request
        self.since = time.perf_counter()
        self.seconds = dict.fromkeys(("sync", "bound", "starved"), 0.0)

    def now(self, why: str | None, at: float | None = None) -> None:
        at = time.perf_counter() if at is None else at
        if self.why is not None:
            self.seconds[self.why] += at - self.since
        self.why, self.since = why, at

    def take(self, at: float) -> dict[str, float]:
        self.now(self.why, at)
        taken, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return taken
