"""How long a simulated actor takes to decode a lease, with and without refilled rows.

An actor decodes a lease's n x G completions as one batch of that many rows. On
a Mac a small model's decode step is bound by memory bandwidth, so a step costs
the same whether every row is still decoding or not: a row whose completion
has ended idles until the batch ends, unless it is refilled.

- Without refill the batch runs until its longest completion ends: a group waits
  for its longest completion, and a lease for its longest group.
- With refill a row that finishes takes the next lease's work at once (the actor
  holds its next lease while it generates, `FleetSimulation.pending`). The next
  lease then starts with a head start on every row that ended early and is
  charged only what is left. An actor refused its next lease has nothing to
  refill with, and its rows' head start is lost. As the actor does
  (`actor.rolling`), a refilling batch holds one policy version: new work
  starts at the loaded weights while `may_refill` allows, and only a drained
  batch (its head start lost) swaps in the newest.

With one length for every completion the two are the same, and the same as the
simulator's old `seconds_per_group` model, which an actor without a length
distribution keeps.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Sequence

from grpo_fleet.simulator.specs import ActorSpec


@dataclass(frozen=True)
class BatchDecode:
    """One lease's batch: its seconds, and the head start it leaves the next lease's rows (refill only)."""

    seconds: float
    head_start: tuple[float, ...]  # per row, seconds it was free before the batch ended
    useful_seconds: float  # the batch's seconds had no row idled: its tokens x token_seconds


@dataclass(frozen=True)
class SampledGroup:
    """One generated group's completion lengths, as the learner's step pays for them."""

    tokens: int  # completion tokens of its G completions
    longest: int  # its longest completion
    rows: int  # its completions: G


def decode_batch(lengths: Sequence[int], token_seconds: float, head_start: Sequence[float] = ()) -> BatchDecode:
    """Decode `lengths` as one batch of len(lengths) rows; a step of every row costs rows x `token_seconds`.

    A row with a head start (refill: it ended the last lease early and took this
    one's work then) is charged only what is left of it. Completions go, in the
    order drawn, to the row free soonest, as the actor's queue hands them out
    (lengths are not known in advance); a row free early may take several.
    Without a head start every row takes one, and the batch waits for its longest.
    """
    rows = len(lengths)
    step = rows * token_seconds
    free = sorted(-s for s in head_start)[:rows]  # the rows free longest
    free += [0.0] * (rows - len(free))
    heapq.heapify(free)
    for tokens in lengths:
        heapq.heappush(free, heapq.heappop(free) + tokens * step)
    seconds = max(0.0, max(free, default=0.0))
    return BatchDecode(seconds, tuple(seconds - end for end in free), sum(lengths) * token_seconds)


class Decoding:
    """The actors' leases in seconds: each actor's seeded length draw, its rows' head start, and the idle rows."""

    def __init__(self, actors: list[ActorSpec], seed: int) -> None:
        self.actors = actors
        self.draws = [random.Random(seed * 1_000_003 + index) for index in range(len(actors))]
        self.head_starts: list[tuple[float, ...]] = [() for _ in actors]
        self.decode_seconds = self.useful_seconds = 0.0

    def lease(self, index: int, groups: int) -> tuple[float, list[SampledGroup]]:
        """Seconds actor `index` decodes a lease of `groups` groups, and the groups' lengths."""
        actor = self.actors[index]
        if actor.lengths is None:  # the old model: a fixed cost a group, no lengths
            return groups * actor.seconds_per_group, [SampledGroup(0, 0, 0)] * groups
        size = actor.group_size
        lengths = actor.lengths.sample(self.draws[index], groups * size)
        batch = decode_batch(lengths, actor.token_seconds, self.head_starts[index])
        self.head_starts[index] = batch.head_start if actor.refill else ()
        self.decode_seconds += batch.seconds
        self.useful_seconds += batch.useful_seconds
        rows = [lengths[g * size:(g + 1) * size] for g in range(groups)]
        return batch.seconds, [SampledGroup(sum(row), max(row), size) for row in rows]

    def refilling(self, index: int) -> bool:
        """Whether actor `index`'s rows are still decoding (some ended early and took new work) as a lease ends."""
        return any(seconds > 0.0 for seconds in self.head_starts[index])

    def wait(self, index: int) -> None:
        """Actor `index` was refused its next lease: its rows idle, and their head start is lost."""
        self.head_starts[index] = ()

    def idle_fraction(self) -> float:
        """The share of the actors' decoding row-seconds in which a row decoded nothing."""
        if self.decode_seconds <= 0.0:
            return 0.0
        return max(0.0, 1.0 - self.useful_seconds / self.decode_seconds)
