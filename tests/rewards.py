"""Reward functions for the tests of `reward.function` (imported by name in the grader's workers)."""

import time


def length(prompt, completions, answer, **columns):
    """Each response's length in characters."""
    return [len(c) for c in completions]


def weighted_match(prompt, completions, answer, **columns):
    """The row's `weight` column where the response contains the answer, else 0; and -1 for a
    response that contains the prompt (so the prompt arrives too)."""
    return [-1.0 if prompt in c else float(columns["weight"]) * (answer in c) for c in completions]


def from_solution_column(prompt, completions, answer, **columns):
    """1 where the response contains the row's `solution` field: a dataset that calls it `answer`
    scores nothing (what a user's reward reading a column of another dataset does)."""
    return [float(bool(columns.get("solution")) and columns["solution"] in c) for c in completions]


def raises(prompt, completions, answer, **columns):
    raise KeyError("no such column\nsecond line")


def too_few(prompt, completions, answer, **columns):
    return [1.0] * (len(completions) - 1)


def not_numbers(prompt, completions, answer, **columns):
    return ["1.0"] * len(completions)


def infinite(prompt, completions, answer, **columns):
    return [float("inf")] * len(completions)


def slow_on_seven(prompt, completions, answer, **columns):
    """Takes 30 s for the problem whose answer is 7, answers 1 at once otherwise."""
    if answer == "7":
        time.sleep(30)
    return [1.0] * len(completions)


NOT_CALLABLE = 3
