"""The simulation's clock and its jobs: events in time order, and processor sharing on one host.

Kept apart from the fleet's rules (simulation.py), so that those read as what the actors and the learner do,
and this as how long it takes when they share a machine.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from grpo_fleet.simulator.decoding import SampledGroup
from grpo_fleet.simulator.specs import SharedHost


@dataclass
class Job:
    """Work under way: a lease being generated (an actor's) or a step (the learner's, key -1)."""

    finish: float  # at the current sharing rate
    cores: float
    token: int  # only the newest finish event of a job counts (its finish moves when the rate changes)
    started: float = 0.0
    groups: int = 0
    version: int = 0
    sampled: list[SampledGroup] = field(default_factory=list)  # a lease's groups' lengths


class SharedJobs:
    """Events in time order and the jobs under way: on a shared host every busy process wants some cores, and
    when they want more than the host has, each runs slower by the same factor (each job's finish moves)."""

    def __init__(self, host: Optional[SharedHost]) -> None:
        self.host = host
        self.now = 0.0
        self.events: list[tuple[float, int, str, int, int, int]] = []
        self.order = itertools.count()  # breaks time ties in insertion order
        self.tokens = itertools.count()
        self.jobs: dict[int, Job] = {}

    def at(self, when: float, kind: str, index: int = -1, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, index, a, b))

    def pop(self) -> tuple[str, int, int, int]:
        """The next event, (kind, index, a, b); the clock moves to its time."""
        self.now, _, kind, index, a, b = heapq.heappop(self.events)
        return kind, index, a, b

    def is_newest_finish(self, key: int, token: int) -> bool:
        """Whether a finish event is its job's newest (an older one was moved by a rate change)."""
        return key in self.jobs and self.jobs[key].token == token

    def rate(self) -> float:
        """How fast every job runs now: 1 on machines of their own; on a shared host, less when oversubscribed."""
        if self.host is None:
            return 1.0
        wanted = sum(job.cores for job in self.jobs.values())
        return min(1.0, self.host.cores / wanted) if wanted > 0 else 1.0

    def _schedule(self, key: int, job: Job) -> None:
        job.token = next(self.tokens)
        self.at(job.finish, "finish", key, job.token)

    def _change_jobs(self, change: Callable[[], object], started: Optional[int] = None) -> None:
        """Start or end a job; on a shared host every other job's finish moves with the new rate."""
        before = self.rate()
        change()
        after = self.rate()
        if after != before:
            for key, job in self.jobs.items():
                if key != started:
                    job.finish = self.now + (job.finish - self.now) * before / after
                    self._schedule(key, job)

    def begin(self, key: int, seconds: float, cores: float, groups: int = 0, version: int = 0,
              sampled: Optional[list[SampledGroup]] = None) -> None:
        """A job of `seconds` alone-time starts now."""
        job = Job(finish=self.now, cores=cores, token=0, started=self.now, groups=groups, version=version,
                  sampled=sampled or [])
        self._change_jobs(lambda: self.jobs.__setitem__(key, job), started=key)
        job.finish = self.now + seconds / self.rate()
        self._schedule(key, job)

    def extend(self, key: int, seconds: float) -> None:
        job = self.jobs[key]
        job.finish += seconds / self.rate()
        self._schedule(key, job)

    def end(self, key: int) -> Job:
        """A job done: out of the running, the others sped up if it shared the host."""
        job = self.jobs[key]
        self._change_jobs(lambda: self.jobs.pop(key))
        return job
