"""The builtin environments of `[env] name`.

- `builtin:retry` (`Retry`): the model's answer is graded (its last box against the gold answer);
  a wrong one is told so and may try again, up to `env.max_turns` attempts. No tool format needed, so
  any chat model (SmolLM2 included) can run it. Reward 1 once an attempt is right, else 0.
- `builtin:calculator` (`Calculator`): one tool, `calculator(expression)`, evaluating + - * / // %
  and parentheses on numbers exactly; `[reward]` grades the final answer.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from m2po_cli.answers import grade

RETRY_MESSAGE = "That answer is wrong. Try again, and put the final answer in \\boxed{}."


class Retry:
    """Grade each attempt; ask again after a wrong one (the episode ends on a right one)."""

    def __init__(self) -> None:
        self.answer, self.solved = "", False

    def reset(self, row: dict[str, Any]) -> None:
        self.answer, self.solved = str(row["answer"]), False

    def step(self, text: str) -> str | None:
        self.solved = grade(text, self.answer) == 1.0
        return None if self.solved else RETRY_MESSAGE

    def reward(self) -> float:
        return float(self.solved)


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_DIGITS = 64  # operands and results longer than this are refused (no runaway arithmetic)


class Calculator:
    """A calculator tool for arithmetic the model cannot do in its head."""

    def reset(self, row: dict[str, Any]) -> None:
        """Nothing to set up: the calculator keeps no state."""

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly: numbers, + - * / // %, parentheses.

        Args:
            expression: The expression to evaluate, for example (12+30)*7.
        """
        value = _evaluate(ast.parse(expression, mode="eval").body)
        return str(value.numerator) if value.denominator == 1 else str(float(value))


def _evaluate(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        value = Fraction(OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    else:
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")
    if len(str(abs(value.numerator))) > MAX_DIGITS:
        raise ValueError(f"a number of more than {MAX_DIGITS} digits")
    return value


BUILTINS: dict[str, type] = {"builtin:retry": Retry, "builtin:calculator": Calculator}
