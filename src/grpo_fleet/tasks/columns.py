"""Dataset rows to Examples: which column is the prompt, which the answer, and checks that name the bad row."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from grpo_fleet.tasks.examples import Example
from grpo_fleet.tasks.rewards import gold_answer_text

# Tried in order when task.prompt_column is not set: TRL's name, then GSM8K's.
DEFAULT_PROMPT_COLUMNS = ("prompt", "question")


def prompt_column_of(columns: Sequence[str], configured: Optional[str], source: str) -> str:
    """The configured prompt column, else the first default one the dataset has; errors name what exists."""
    if configured is not None:
        require_column(columns, configured, "task.prompt_column", source)
        return configured
    found = next((name for name in DEFAULT_PROMPT_COLUMNS if name in columns), None)
    if found is None:
        raise ValueError(
            f"{source} has no 'prompt' or 'question' column; its columns are {', '.join(columns)}: "
            "set task.prompt_column"
        )
    return found


def require_column(columns: Sequence[str], name: str, setting: str, source: str) -> None:
    """ValueError unless `name` is one of `columns`, listing the columns there are."""
    if name not in columns:
        raise ValueError(f"{source} has no column {name!r} ({setting}); its columns are {', '.join(columns)}")


def examples_from_rows(
    rows: Iterable[Mapping[str, Any]], *, prompt_column: str, answer_column: str, source: str
) -> list[Example]:
    """One Example per row: the prompt, the final answer, and every column but the prompt kept as loaded."""
    examples = []
    for index, row in enumerate(rows):
        try:
            examples.append(
                Example(
                    prompt=read_prompt(row[prompt_column], prompt_column),
                    answer=read_answer(row[answer_column], answer_column),
                    columns={name: value for name, value in row.items() if name != prompt_column},
                )
            )
        except ValueError as error:
            raise ValueError(f"{source} row {index}: {error}") from None
    return examples


def read_prompt(value: Any, column: str) -> Any:
    """Text, or a chat-format list of {role, content} messages (kept as a tuple of dicts)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"column {column!r} is empty")
        return value
    if isinstance(value, (list, tuple)) and value and all(_is_message(m) for m in value):
        return tuple(dict(m) for m in value)
    raise ValueError(
        f"column {column!r} must be text or a non-empty list of {{'role': str, 'content': str}} messages, "
        f"got {_describe(value)}"
    )


def read_answer(value: Any, column: str) -> str:
    """The reference answer as text; GSM8K's worked solution ending in '#### 1,800' gives '1800'."""
    # bool is an int subclass, but `true` as an answer is almost surely a data bug.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"column {column!r} must be text or a number, got {_describe(value)}")
    text = value if isinstance(value, str) else str(value)
    answer = gold_answer_text(text).strip()
    if not answer:
        raise ValueError(f"column {column!r} is empty")
    return answer


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
