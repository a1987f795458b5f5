"""Prompts to token ids: the one encoding the learner and the evaluator share, and the length check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any, Optional, Union

# A prompt is raw user text, or a chat-format conversation of {"role", "content"} messages.
Prompt = Union[str, Sequence[Mapping[str, Any]]]


class PromptTooLong(ValueError):
    """Prompts that leave no room for the completion within the model's context."""


def chat_messages(prompt: Prompt, system_prompt: Optional[str] = None) -> list[dict[str, Any]]:
    """The conversation a prompt stands for; `system_prompt` leads unless it already opens with a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat_template: bool, system_prompt: Optional[str] = None) -> list[int]:
    """Tokenize a prompt the way learner and evaluator must: through the chat template when asked.

    A chat-format prompt (a list of messages) always goes through the template:
    there is no other way to turn a conversation into text.
    """
    if isinstance(prompt, str) and not chat_template:
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    rendered = tokenizer.apply_chat_template(
        chat_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def context_length(model: Any) -> Optional[int]:
    """The longest sequence the model's config allows (mlx-lm's `args.max_position_embeddings`), if it says."""
    value = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def check_prompt_lengths(
    prompts: Sequence[Sized], *, max_new_tokens: int, context: Optional[int], split: str = "train"
) -> None:
    """Refuse prompts too long to leave `max_new_tokens` of room in a `context`-token window (None: no limit)."""
    if context is None:
        return
    room = context - max_new_tokens
    too_long = [(len(tokens), index) for index, tokens in enumerate(prompts) if len(tokens) > room]
    if not too_long:
        return
    length, index = max(too_long)
    raise PromptTooLong(
        f"{len(too_long)} of {len(prompts)} {split} prompts are longer than the model allows: prompt {index} has "
        f"{length} tokens, and the model's context of {context} tokens minus generation.max_tokens = {max_new_tokens} "
        f"leaves {max(room, 0)}; drop or shorten those rows, or lower generation.max_tokens"
    )


def decode_completion(tokenizer: Any, tokens: Sequence[int], finish_reason: str, eos_ids: set[int]) -> str:
    """A completion's text as rewards see it: decoded without its stop token (actor and learner alike)."""
    ids = [int(t) for t in tokens]
    if finish_reason == "stop" and ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    return str(tokenizer.decode(ids))
