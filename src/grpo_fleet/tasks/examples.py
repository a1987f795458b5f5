"""What a task is made of: `Example` rows, and where the data files shipped with the package are.

A module of its own so that the loaders (jsonl, columns, reverse, hf_datasets) and
the `Task` that builds on them (tasks/__init__.py) import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_fleet.tasks.prompts import Prompt

DATA_DIR = Path(__file__).parent / "data"
# A task path "builtin:gsm8k_mini" names a file shipped in DATA_DIR, so configs
# need not know where the package is installed.
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer, plus the rest of its dataset row.

    `prompt` is raw user text (before any chat template) or a chat-format tuple
    of {"role", "content"} messages. `columns` holds every column of a
    `datasets` row but the prompt, as loaded (GSM8K's whole worked solution
    among them), for rewards that want more than the answer; treat it as
    read-only. JSONL and built-in tasks leave it empty.
    """

    prompt: Prompt
    answer: str
    columns: Mapping[str, Any] = field(default_factory=dict)


def data_path(name: str) -> Path:
    """Path of a data file shipped with the package, e.g. data_path("gsm8k_mini.jsonl")."""
    for candidate in (DATA_DIR / name, DATA_DIR / f"{name}.jsonl"):
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(path.name for path in DATA_DIR.glob("*.jsonl"))) or "(none)"
    raise FileNotFoundError(f"no bundled data file {name!r}; available: {available}")


def resolve_task_path(path: str) -> Path:
    """A task file path, where "builtin:NAME" means a file shipped with the package."""
    if path.startswith(BUILTIN_PREFIX):
        return data_path(path[len(BUILTIN_PREFIX) :])
    return Path(path).expanduser()
