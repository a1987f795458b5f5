"""Load {prompt, answer} examples from JSON Lines files.

Accepts this project's own keys ({"prompt", "answer"}) and GSM8K's
({"question", "answer"} with the answer ending in "#### N"). A prompt is text,
or a chat conversation: a list of {"role", "content"} messages ending with the
user's (worked examples before the question, as in the tool-use recipe). Errors
name the file and line so a bad row in a large dataset is easy to find.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from grpo_fleet.tasks.examples import Example
from grpo_fleet.tasks.prompts import Prompt

PROMPT_KEYS = ("prompt", "question")
ROLES = ("system", "user", "assistant")


def load_jsonl(path: Union[str, Path]) -> list[Example]:
    """Every example in a JSONL file; blank lines are skipped.

    Raises ValueError naming the file, the 1-based line number and the problem
    for invalid JSON, a missing key or a value of the wrong type.
    """
    path = Path(path)
    examples: list[Example] = []
    # utf-8-sig: files saved by some editors start with a BOM that json rejects.
    with path.open(encoding="utf-8-sig") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                examples.append(_parse_line(line))
            except ValueError as error:
                raise ValueError(f"{path}:{line_number}: {error}") from None
    return examples


def _parse_line(line: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return Example(prompt=_prompt_of(record), answer=_answer_of(record))


def _prompt_of(record: dict[str, Any]) -> Prompt:
    key = next((key for key in PROMPT_KEYS if key in record), None)
    if key is None:
        raise ValueError("missing key 'prompt' (or GSM8K's 'question')")
    prompt = record[key]
    if isinstance(prompt, list):
        return _conversation(key, prompt)
    if not isinstance(prompt, str):
        raise ValueError(f"'{key}' must be a string or a list of messages, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"'{key}' is empty")
    return prompt


def _conversation(key: str, messages: list[Any]) -> tuple[dict[str, str], ...]:
    """A chat-format prompt: {"role", "content"} messages of system, user or assistant, the last one the user's."""
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or set(message) != {"role", "content"} or message["role"] not in ROLES
                or not isinstance(message["content"], str)):
            raise ValueError(f"'{key}'[{index}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": "
                             "text}")
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(f"'{key}' must end with the user's message (the one the model answers)")
    return tuple(dict(message) for message in messages)


def _answer_of(record: dict[str, Any]) -> str:
    if "answer" not in record:
        raise ValueError("missing key 'answer'")
    answer = record["answer"]
    # bool is an int subclass, but `true` as an answer is almost surely a data bug.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be a string or a number, got {type(answer).__name__}")
    return answer if isinstance(answer, str) else str(answer)
