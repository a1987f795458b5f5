"""Prompt text to token ids: the one encoding the learner, the actors and the evaluator share."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str, *, chat_template: bool, system_prompt: str | None = None) -> list[int]:
    """Tokenize a prompt the way both learner and evaluator must: optionally through the chat template."""
    if not chat_template:
        return list(tokenizer.encode(text, add_special_tokens=False))
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))
