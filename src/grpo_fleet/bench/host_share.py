"""How many of a shared host's cores other work took while a fleet ran: what the fleet had left.

A benchmark on a machine other people use (this project's 2-vCPU VM runs other
sessions' tests and demos beside it) cannot choose its quiet. So the fleet
simulator is told what the fleet had: the host's cores, less the cores the
rest of the host kept busy over the run. That is the host's busy CPU time
(Linux `/proc/stat`) less the fleet's own processes' and their children's (the
reward processes; `/proc/PID/stat`), over the wall time between the first and
the last sample. Elsewhere (no `/proc`) it
reads 0: the host is taken as the fleet's alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_busy_seconds() -> float:
    """CPU seconds every core of the host has spent busy since boot (0 without /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after "pid (comm) " (the state first); [] once it is gone or without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2:].split()


def process_seconds(pid: int) -> float:
    """CPU seconds of process `pid` and its children it has waited for (0 once it is gone, or without /proc)."""
    fields = _stat(pid)
    return sum(int(x) for x in fields[11:15]) / TICKS if fields else 0.0  # utime stime cutime cstime


def descendants(roots: list[int]) -> list[int]:
    """The live processes under `roots` (children, grandchildren, ...), without the roots."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name))
        if fields:
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(found)


@dataclass
class HostShare:
    """Samples of (wall, host busy, the fleet's busy) seconds; the fleet's processes are `pids`."""

    pids: list[int]
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def sample(self) -> None:
        own = [process_seconds(pid) for pid in self.pids]
        if all(seconds > 0 for seconds in own):  # every process still there: a sample that counts them all
            children = sum(process_seconds(pid) for pid in descendants(self.pids))
            self.samples.append((time.perf_counter(), host_busy_seconds(), sum(own) + children))

    def other_cores(self, since: int = 0) -> float:
        """Cores the rest of the host kept busy, on average, between sample `since` (the first) and the last."""
        if len(self.samples) - since < 2:
            return 0.0
        (wall0, host0, own0), (wall1, host1, own1) = self.samples[since], self.samples[-1]
        return max(0.0, ((host1 - host0) - (own1 - own0)) / (wall1 - wall0)) if wall1 > wall0 else 0.0

    def fleet_cores(self, since: int = 0) -> float:
        """Cores the fleet's own processes kept busy, on average, between sample `since` and the last."""
        if len(self.samples) - since < 2:
            return 0.0
        (wall0, _, own0), (wall1, _, own1) = self.samples[since], self.samples[-1]
        return max(0.0, (own1 - own0) / (wall1 - wall0)) if wall1 > wall0 else 0.0
