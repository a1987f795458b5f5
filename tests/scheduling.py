"""The order tests run in: the longest first, dealt so that every pytest-xdist worker starts with its share.

`--dist worksteal` gives each worker one contiguous slice of the collected
order and later lets an idle worker steal the back half of the longest queue.
Sorted longest-first across the whole list, every long test would land in the
first worker's slice and run there one after another. So the tests are dealt
into slices of the sizes worksteal cuts (longest first, each to the slice with
the least time so far), and each slice runs longest first: what is stolen,
and what runs last, are the short tests.

Durations come from tests/durations.json (wall seconds per test id, setup and teardown
included, from a `make test` run here). `make test` prints every phase of a second or
more; to rewrite the file, pass a run's output: `python tests/scheduling.py test.log`
(JSON lines of {"test": id, "wall": seconds} are read too).
A test not in it is taken to be short, unless it is marked slow.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable, Sequence, TypeVar

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_SECONDS = 0.5
UNKNOWN_SLOW_SECONDS = 60.0
RECORDED_FROM_SECONDS = 1.0  # shorter tests are left out of the file: they are all "short"

T = TypeVar("T")


def known_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def worksteal_slices(count: int, workers: int) -> list[int]:
    """The slice sizes pytest-xdist's worksteal scheduler cuts `count` tests into, in order."""
    sizes, remaining = [], count
    for index in range(workers):
        sizes.append(remaining // (workers - index))
        remaining -= sizes[-1]
    return sizes


def balanced_order(items: Sequence[T], seconds: Callable[[T], float], workers: int) -> list[T]:
    """`items` dealt into worksteal's slices, longest first, each to the slice with the least time so far."""
    longest_first = sorted(range(len(items)), key=lambda i: -seconds(items[i]))  # stable for equal times
    sizes = worksteal_slices(len(items), max(1, workers))
    slices: list[list[int]] = [[] for _ in sizes]
    loads = [0.0] * len(sizes)
    for index in longest_first:
        open_slices = [k for k in range(len(sizes)) if len(slices[k]) < sizes[k]]
        target = min(open_slices, key=lambda k: loads[k])
        slices[target].append(index)
        loads[target] += seconds(items[index])
    return [items[i] for chunk in slices for i in chunk]


# A line of pytest's --durations report: "12.34s call     tests/x.py::test_y[param]".
REPORT_LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown) +(\S.*)$")


def walls(log_lines: Sequence[str]) -> dict[str, float]:
    """Seconds per test id: JSON lines of {"test", "wall"}, or pytest's --durations lines (phases summed)."""
    seconds: dict[str, float] = {}
    for line in log_lines:
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            seconds[row["test"]] = seconds.get(row["test"], 0.0) + float(row["wall"])
        elif (match := REPORT_LINE.match(line)) is not None:
            seconds[match.group(3)] = seconds.get(match.group(3), 0.0) + float(match.group(1))
    return seconds


def record(log_lines: Sequence[str], path: Path = DURATIONS) -> None:
    """Rewrite the durations file from a run's report (see `walls`)."""
    kept = {test: round(wall, 1) for test, wall in walls(log_lines).items() if wall >= RECORDED_FROM_SECONDS}
    path.write_text(json.dumps(dict(sorted(kept.items())), indent=0) + "\n")


if __name__ == "__main__":
    record([line for name in sys.argv[1:] for line in Path(name).read_text().splitlines()])
