"""Environment classes for the tests of `[env] name` (imported by name, as a user's would be)."""

import time


class Echo:
    """A step environment: answers every turn with its text reversed; the episode's reward is its
    number of turns."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        self.turns = 0
        return f"Problem {row['problem']}: reverse what you say."

    def step(self, text):
        self.turns += 1
        return text[::-1]

    def reward(self):
        return float(self.turns)


class Tools:
    """Two tools: one that adds, one that sleeps longer than any test's time-out or raises."""

    def reset(self, row):
        pass

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    def slow(self, seconds: float) -> str:
        """Sleep, or fail for a negative time.

        Args:
            seconds: How long.
        """
        if seconds < 0:
            raise ValueError("negative time")
        time.sleep(seconds)
        return "awake"


class NoDocstring:
    def reset(self, row):
        pass

    def tool(self, x: int) -> int:
        return x


class BothKinds(Tools):
    def step(self, text):
        return None


class NeedsArguments:
    def __init__(self, config):
        self.config = config

    def reset(self, row):
        pass

    def step(self, text):
        return None


class ResetTakesNothing:
    def reset(self):
        pass

    def step(self, text):
        return None


not_a_class = 3
