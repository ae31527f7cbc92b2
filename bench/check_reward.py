"""The GPU check's reward (`reward.function = "check_reward:text_parity"`, with bench/ on the path).

A model with random weights never solves the task, so the math grader would give every response 0
and every update a zero advantage: no gradient, nothing for the push to carry. This reward varies
within a group whatever the model says, so the check's M2PO updates change the weights.
"""

import zlib


def text_parity(prompt, completions, answer, **columns):
    """1 for a response whose text hashes odd (CRC-32), 0 otherwise; an empty response scores 0."""
    return [float(zlib.crc32(c.encode()) & 1) for c in completions]
