"""`grpo-fleet samples RUN_DIR`: the last rows of samples.jsonl, readable and safe to print in a terminal.

Completions are whatever the model wrote: ANSI escapes, carriage returns and NULs
included. Every string from the file goes through `protocol.logsafe.shown`, line
by line, so newlines still break lines and nothing else reaches the terminal raw.
"""

from __future__ import annotations

import json
import textwrap
from collections import deque
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Optional, get_origin, get_type_hints

from grpo_fleet.learner.records.runlog import SAMPLES_FILE, SampleRow
from grpo_fleet.protocol.logsafe import shown

INDENT = "    "
_FIELD_TYPES = get_type_hints(SampleRow)


class SamplesError(Exception):
    """The run directory or its samples.jsonl is missing."""


@dataclass(frozen=True)
class SamplesRead:
    rows: list[SampleRow]  # the last ones asked for, oldest first
    skipped: int  # lines that are not a whole row: a learner killed mid-write leaves one


def row_from_json(line: str) -> Optional[SampleRow]:
    """A samples.jsonl line as a row, or None if it is cut off or not a row."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    # Fields with a default (an episode's turns and end) may be absent: rows written before them.
    present = [f for f in fields(SampleRow) if f.name in data or f.default is MISSING and f.default_factory is MISSING]
    if not all(_typed(data.get(f.name), _FIELD_TYPES[f.name]) for f in present):
        return None
    return SampleRow(**{f.name: data[f.name] for f in present})


def _typed(value: Any, kind: Any) -> bool:
    if isinstance(value, bool):
        return False
    if get_origin(kind) is list:  # an episode's turns: [[who, text], ...]
        return isinstance(value, list) and all(
            isinstance(run, list) and len(run) == 2 and all(isinstance(x, str) for x in run) for run in value)
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def read_last_rows(run_dir: Path, count: int) -> SamplesRead:
    """The last `count` whole rows of RUN_DIR/samples.jsonl, read in one pass with at most `count` kept."""
    if not run_dir.is_dir():
        raise SamplesError(f"{run_dir} is not a run directory")
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        raise SamplesError(f"{run_dir} has no {SAMPLES_FILE} (written by learners with train.log_samples_every > 0)")
    rows: deque[SampleRow] = deque(maxlen=count)
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            row = row_from_json(line)
            if row is None:
                skipped += 1
            else:
                rows.append(row)
    return SamplesRead(list(rows), skipped)


def header(row: SampleRow) -> str:
    """One line naming the row: step, sampling version, reward, advantage, finish reason, actor, group."""
    return (f"step {row.step}  v{row.policy_version}  reward {row.reward:.3f}  advantage {row.advantage:+.3f}  "
            f"{shown(row.finish_reason, 32)}  {row.num_tokens} tokens  actor {shown(row.actor_id, 64)}  "
            f"group {shown(row.group_id, 64)} (prompt {row.prompt_index})")


def wrapped(text: str, width: int, max_chars: int) -> list[str]:
    """`text` escaped line by line, cut after `max_chars` characters, wrapped to `width` under INDENT."""
    cut = len(text) - max_chars
    lines: list[str] = []
    for line in text[:max_chars].split("\n"):
        safe = shown(line, len(line))
        pieces = textwrap.wrap(safe, max(20, width - len(INDENT)), drop_whitespace=False, break_on_hyphens=False)
        lines.extend(INDENT + piece for piece in pieces or [""])
    if cut > 0:
        lines.append(f"{INDENT}... ({cut} more characters)")
    return lines


def format_row(row: SampleRow, width: int = 100, max_chars: int = 2000) -> str:
    """A row as a header line, then its prompt and its completion, each wrapped and indented."""
    if row.turns:
        return "\n".join([header(row), "  prompt:", *wrapped(row.prompt, width, max_chars), *episode_lines(row, width,
                                                                                                       max_chars)])
    completion = wrapped(row.completion, width, max_chars) if row.completion else [f"{INDENT}(empty)"]
    return "\n".join([header(row), "  prompt:", *wrapped(row.prompt, width, max_chars), "  completion:", *completion])


def episode_lines(row: SampleRow, width: int, max_chars: int) -> list[str]:
    """An episode turn by turn: each model turn, numbered, and what the environment answered after it."""
    lines, turn = [], 0
    for who, text in row.turns:
        turn += who == "model"
        label = f"  turn {turn} (model):" if who == "model" else "  environment:"
        lines.extend([label, *(wrapped(text, width, max_chars) if text else [f"{INDENT}(empty)"])])
    lines.append(f"  episode ended: {shown(row.end, 32)}")
    return lines


def format_samples(read: SamplesRead, width: int = 100, max_chars: int = 2000) -> str:
    """The rows one after another, a blank line between them; or why there are none."""
    if not read.rows:
        return "no samples yet: a learner writes them every train.log_samples_every steps"
    return "\n\n".join(format_row(row, width, max_chars) for row in read.rows)
