"""Load {prompt, answer} examples from JSON Lines files.

Accepts this project's own keys ({"prompt", "answer"}) and GSM8K's
({"question", "answer"} with the answer ending in "#### N"). Errors name the
file and line so a bad row in a large dataset is easy to find.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from grpo_fleet.tasks.examples import Example

PROMPT_KEYS = ("prompt", "question")


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


def _prompt_of(record: dict[str, Any]) -> str:
    key = next((key for key in PROMPT_KEYS if key in record), None)
    if key is None:
        raise ValueError("missing key 'prompt' (or GSM8K's 'question')")
    prompt = record[key]
    if not isinstance(prompt, str):
        raise ValueError(f"'{key}' must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"'{key}' is empty")
    return prompt


def _answer_of(record: dict[str, Any]) -> str:
    if "answer" not in record:
        raise ValueError("missing key 'answer'")
    answer = record["answer"]
    # bool is an int subclass, but `true` as an answer is almost surely a data bug.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be a string or a number, got {type(answer).__name__}")
    return answer if isinstance(answer, str) else str(answer)
