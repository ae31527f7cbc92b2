"""An episode's later turns as tokens: the environment's messages rendered by the model's chat template
after the model's own sampled tokens, never re-rendering (or re-encoding) what came before.

An episode is the prompt, then the model's sampled turn, each ending with the end-of-turn token the
model stopped on, then the environment's messages, then the model's next turn, and so on. Sampled ids
stay as sampled. The environment's messages join as suffix tokens: what the template writes after
the model's end-of-turn token (the boundary it puts there, a newline in ChatML, included), the
messages, and the next generation prompt. `ChatTurns.suffix` renders them once per turn, so an
episode of T turns costs T renders of its new messages, not T renders of its whole history.

That is only right when the template renders an earlier turn the same way whatever follows it.
`ChatTurns.check` renders a probe conversation with and without a message appended and refuses a
template that changes the earlier turns (Qwen3's drops the thinking of earlier turns, for one),
naming the first token that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from m2po_cli.errors import UserError

Message = dict[str, Any]  # {"role": ..., "content": ...} and what else a template reads

# The probe conversation: a user turn and an answer, then a message of each role an environment sends.
PROBE = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
APPENDED_ROLES = ("tool", "user")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (one ending first counts), or None."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        return min(len(a), len(b))
    return first


class TemplateError(UserError):
    """The model's chat template cannot extend an episode turn by turn; the message says why."""


class ChatTurns:
    """Suffix tokens of environment messages for one tokenizer's chat template.

    `end_of_turn` are the token ids a model turn may stop on (the engine's stop tokens: EOS and the
    generation config's). `tools` are the JSON schemas the prompt announces, passed to every render
    so a template that lays out its system turn from them renders the same prefix each time."""

    def __init__(
        self, tokenizer: Any, end_of_turn: Sequence[int], name: str, tools: list[dict] | None = None
    ):
        self.tokenizer, self.end_of_turn, self.name = tokenizer, set(end_of_turn), name
        self.tools = tools or None
        # Rendered once: every turn's suffix is read against them.
        self.probe = self.render(PROBE, generation_prompt=False)
        self.answer_start = len(self.render(PROBE[:1], generation_prompt=True))

    def render(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def check(self) -> None:
        """Refuse, in one line, a template whose earlier turns change when a message is appended, or
        that does not end the model's turn with one of its end-of-turn tokens."""
        before = self.probe
        for role in APPENDED_ROLES:
            after = self.render([*PROBE, {"role": role, "content": "3"}], generation_prompt=True)
            first = first_difference(before, after[: len(before)])
            if first is not None:
                was = self._token(before, first)
                became = self._token(after, first)
                raise TemplateError(
                    f"the chat template of {self.name} rewrites earlier turns when a {role} message is "
                    f"appended: token {first} of the probe conversation is {was} before and {became} after, "
                    "so an episode's tokens could not be extended turn by turn (docs/environments.md)"
                )
        self._model_turn_end(before)

    def suffix(self, messages: list[Message]) -> list[int]:
        """The tokens that follow a model turn's end-of-turn token when `messages` come next: the
        template's boundary after that token, the messages, and the generation prompt."""
        after = self.render([*PROBE, *messages], generation_prompt=True)
        assert after[: len(self.probe)] == self.probe, "the template changed earlier turns (ChatTurns.check)"
        return after[self._model_turn_end(after) + 1 :]

    def _model_turn_end(self, tokens: list[int]) -> int:
        """Where the probe's model turn ends: the first end-of-turn token after its generation prompt."""
        end = next((i for i in range(self.answer_start, len(tokens)) if tokens[i] in self.end_of_turn), None)
        if end is None:
            raise TemplateError(
                f"the chat template of {self.name} does not end an assistant turn with an end-of-turn "
                f"token the model stops on ({sorted(self.end_of_turn)})"
            )
        return end

    def _token(self, tokens: list[int], i: int) -> str:
        return repr(self.tokenizer.decode(tokens[i : i + 1])) if i < len(tokens) else "the end"
