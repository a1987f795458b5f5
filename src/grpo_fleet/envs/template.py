"""Observation tokens from the chat template's difference between turns: token in, token out.

The model's turns are kept as the ids it sampled; only what the environment adds
is tokenized, and only that. The chunk that follows a turn is found as text:

    before = template(conversation + [assistant: MARK])
    after  = template(conversation + [assistant: MARK] + observations, add_generation_prompt=True)
    chunk  = (before's tail after MARK, from past the stop token the model sampled) + after[len(before):]

so it holds what the template puts after an assistant message (ChatML's "\\n"
after <|im_end|>, or the closing marker itself when the turn was cut off before
its stop token), the observation messages, and the next assistant header. A
placeholder stands for the turn being closed, so the model's own text is never
rendered back into tokens. Diffing text rather than token ids works for templates
whose token prefix does not hold; a template whose text prefix does not hold
either (one that rewrites earlier turns) is refused with `TemplateError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Stands for the closed turn's text while rendering; nothing a template or a model would write.
TURN_MARK = "\u2063grpo-fleet-turn\u2063"


class TemplateError(ValueError):
    """The chat template cannot give observation tokens by difference (it rewrites what came before)."""


def render(tokenizer: Any, conversation: list[dict[str, Any]], generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


class ObservationEncoder:
    """The token ids the environment adds after a turn, and the ids of an episode's first prompt."""

    def __init__(self, tokenizer: Any, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_texts = {int(t): str(tokenizer.decode([int(t)])) for t in stop_token_ids}

    def prompt_ids(self, conversation: list[dict[str, Any]]) -> list[int]:
        """The conversation as the model's prompt (chat template, generation prompt): what env.init's reply becomes."""
        return encode_text(self.tokenizer, render(self.tokenizer, conversation, True))

    def chunk(self, conversation: list[dict[str, Any]], last_token: int, observations: list[dict[str, Any]]) -> list[int]:
        """Ids after a turn that ended with `last_token`: the template's close of it, the observations, the next
        assistant header. `conversation` is everything before the turn."""
        return encode_text(self.tokenizer, self.chunk_text(conversation, last_token, observations))

    def chunk_text(self, conversation: list[dict[str, Any]], last_token: int,
                   observations: list[dict[str, Any]]) -> str:
        history = [*conversation, {"role": "assistant", "content": TURN_MARK}]
        before = render(self.tokenizer, history, False)
        after = render(self.tokenizer, [*history, *observations], True)
        if not after.startswith(before) or before.count(TURN_MARK) != 1:
            raise TemplateError(
                "the chat template renders earlier turns differently once observations follow them, so the "
                "environment's tokens cannot be taken as the difference between turns"
            )
        tail = before[before.index(TURN_MARK) + len(TURN_MARK):]
        stop = self.stop_texts.get(int(last_token))
        if stop and stop in tail:  # the model sampled the template's close: the chunk starts after it
            tail = tail[tail.index(stop) + len(stop):]
        return tail + after[len(before):]
