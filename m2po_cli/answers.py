"""When an answer is right: the last `\\boxed{...}` of a response, equivalent to the gold answer under
math-verify. Pure functions, no time limit (`grader.Grader` runs them under one).

This is the paper's protocol (M2PO `verl/utils/reward_score/latex_math.py`): both strings are
wrapped in `$...$` before `math_verify.parse`, because math-verify's LaTeX extractor needs math
delimiters. Two deliberate differences from that code: `verify` gets the gold first, as math-verify
documents (the released code swaps the arguments), and an unbalanced last box falls back to the last
balanced one instead of scoring 0.
"""

from __future__ import annotations

import re

# One token per backslash escape, brace or box opener, so a single left-to-right pass finds every
# balanced box. `\{` and `\}` are literal braces in TeX, not groups: `\left\{ ... \right.` inside a
# box must not unbalance it. A bare box, `\boxed 12`, holds one word: commands, characters and
# brace groups one level deep (`\frac{1}{2}`), up to a space, a `$` or a brace of the text around it.
_BARE_WORD = r"(?:\\[A-Za-z]+|\{[^{}$]*\}|[^\s${}\\])+"
_TOKENS = re.compile(
    rf"(?P<box>\\boxed\s*\{{)|\\boxed[ \t]+(?P<bare>{_BARE_WORD})|(?P<esc>\\.)|(?P<open>\{{)|(?P<close>\}})",
    re.DOTALL,
)


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` in `text` ("last" = the one opened last).

    Braces are matched, so nested groups are kept whole; a box whose brace never closes is
    ignored. `\\boxed {x}` (space before the brace) counts, and so does a bare `\\boxed 12`, whose
    content is the one word after the space (trailing `.` or `,` dropped). Returns None when no box
    is balanced. One regex pass: linear in len(text).
    """
    open_boxes: list[tuple[int, int]] = []  # (brace depth outside the box, content start)
    depth = 0
    last: tuple[int, int] | None = None  # (content start, content end)
    for m in _TOKENS.finditer(text):
        kind = m.lastgroup
        if kind == "box":
            open_boxes.append((depth, m.end()))
            depth += 1
        elif kind == "bare":
            start, end = m.span("bare")
            end -= len(m.group("bare")) - len(m.group("bare").rstrip(".,"))
            if last is None or start > last[0]:
                last = (start, end)
        elif kind == "open":
            depth += 1
        elif kind == "close" and depth > 0:  # a stray `}` at depth 0 closes nothing
            depth -= 1
            if open_boxes and open_boxes[-1][0] == depth:
                start = open_boxes.pop()[1]
                if last is None or start > last[0]:
                    last = (start, m.start())
    return None if last is None else text[last[0] : last[1]]


def in_dollars(s: str) -> str:
    """Wrap in `$...$` unless already delimited (as M2PO's `wrap_math_in_latex`); `\\$` is no delimiter."""
    s = s.strip()
    head = "" if s.startswith("$") else "$"
    tail = "" if s.endswith("$") and not s.endswith("\\$") else "$"
    return f"{head}{s}{tail}"


def answers_match(pred: str, gold: str) -> bool:
    """math-verify equivalence of two bare answers (no time limit: `grader.Grader` sets one)."""
    # Imported here so importing this module (and the grader) stays cheap for the CLI.
    from math_verify import parse, verify

    gold_parsed = parse(in_dollars(gold), parsing_timeout=None)
    pred_parsed = parse(in_dollars(pred), parsing_timeout=None)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def grade(response: str, gold: str) -> float:
    """1.0 if the last boxed answer of `response` is equivalent to `gold`, else 0.0.

    No time limit: use `grader.Grader` for model outputs, which can make sympy run for minutes.
    """
    pred = extract_boxed(response)
    return 0.0 if pred is None else float(answers_match(pred, gold))
