"""One continuous batch kept across leases: a slot that frees takes the next lease's work at once.

`generate_groups` runs one lease per `BatchGenerator`: every sequence starts
together and the batch idles as the short ones finish, until the longest is
done. With answers of 16 to 512 tokens most of the slot time is idle. Here the
generator lives across leases: a lease's groups are queued as soon as nothing
else waits (the G completions of a prompt still share one prefill, through
models/generation.py's own helpers), mlx-lm admits a queued sequence into a slot the
step after one frees, and a lease whose groups have all finished is handed
back at once while its neighbours keep decoding.

Versions stay exact: every sequence in the generator was sampled under one
policy version, and `add` refuses a lease at another version until the
generator is empty. The caller swaps weights only then (`idle`), so a lease's
Rollouts carry the one version all of its tokens were sampled at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, Sequence, TypeVar

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.models.generation import (
    PREFILL_STEP_TOKENS,
    SHARED_PREFIX_MIN_TOKENS,
    GeneratedCompletion,
    SamplingSettings,
    _insert_groups,
    _prefill_distinct,
    _sampled_logprobs,
    make_generator,
)

Key = TypeVar("Key")


class WeightsInFlight(RuntimeError):
    """A lease at another policy version while sequences of the loaded one still decode."""


def may_refill(loaded: int, newest: int, max_staleness: Optional[int]) -> bool:
    """Whether new work may start at the `loaded` version while the learner is at `newest`.

    The learner refuses groups more than `max_staleness` versions behind
    (Welcome says how many; None: only its own version), and sizes a lease to
    come back within about that many of its steps (learner/actors/leasing.py),
    so a lease started late spends its own budget. New work starts only while
    the lag leaves it at least two more steps: lag <= max_staleness - 2, and
    always at the learner's own version. At the default bound of 2 that is the
    learner's own version only: in the tiny demo (2 actors), refilling one
    version behind had 5% of submissions refused stale, against 2.2% at this
    rule and 0.3% for one lease at a time. A learner that went back (a resume)
    names other weights by our number: never refill then.
    """
    if loaded < 0 or newest < loaded:
        return False
    return newest - loaded < max(1, (max_staleness or 0) - 1)


@dataclass
class SlotUsage:
    """Decoding steps of a batch of `batch_size` slots and the rows they decoded.

    Idle fraction = 1 - rows / slots, where a step has `batch_size` slots: a
    slot is idle in a step when no sequence decodes in it (finished, or no work
    waiting). mlx-lm may decode a few rows more than `batch_size` for a step or
    two (sequences leaving prefill join the rows already decoding); such a step
    counts as many slots as rows, none idle.
    """

    batch_size: int
    steps: int = 0
    rows: int = 0
    slots: int = 0

    def count(self, rows: int) -> None:
        self.steps += 1
        self.rows += rows
        self.slots += max(rows, self.batch_size)

    @property
    def idle_slots(self) -> int:
        return self.slots - self.rows

    @property
    def idle_fraction(self) -> float:
        return self.idle_slots / self.slots if self.slots else 0.0


@dataclass
class FinishedLease(Generic[Key]):
    """A lease whose groups have all finished, with the version every one of its tokens was sampled at."""

    key: Key
    version: int
    groups: list[list[GeneratedCompletion]]


@dataclass
class _OpenLease(Generic[Key]):
    key: Key
    group_size: int
    completions: list[Optional[GeneratedCompletion]]
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.completions)

    def groups(self) -> list[list[GeneratedCompletion]]:
        done = [c for c in self.completions if c is not None]
        return [done[i : i + self.group_size] for i in range(0, len(done), self.group_size)]


class RollingGenerator(Generic[Key]):
    """Leases in one continuous batch of `batch_size` slots, at one sampling setting and one version at a time."""

    def __init__(self, model: nn.Module, settings: SamplingSettings, batch_size: int, *,
                 min_shared_prefix: Optional[int] = SHARED_PREFIX_MIN_TOKENS,
                 prefill_step_size: int = PREFILL_STEP_TOKENS) -> None:
        self.settings, self.batch_size = settings, batch_size
        self.version = -1  # of the sequences in flight; any while there are none
        self.usage = SlotUsage(batch_size)
        self._model, self._min_shared_prefix = model, min_shared_prefix
        self._generator = make_generator(model, settings, batch_size, prefill_step_size)
        self._open: dict[int, _OpenLease[Key]] = {}  # by insertion number
        self._owner: dict[int, tuple[int, int]] = {}  # uid -> (insertion number, position in its lease)
        self._sampled: dict[int, tuple[list[int], list[float]]] = {}
        self._inserted = 0

    @property
    def in_flight(self) -> int:
        """Sequences queued or decoding."""
        return len(self._owner)

    @property
    def idle(self) -> bool:
        """Nothing in flight: weights may be swapped now."""
        return not self._owner

    @property
    def wants_work(self) -> bool:
        """No sequence waits for a slot: work queued now takes the next slot that frees, with no step lost."""
        return self.in_flight <= self.batch_size

    def add(self, key: Key, prompts: Sequence[Sequence[int]], version: int) -> None:
        """Queue G sequences per prompt of one lease, sampled at `version` (the loaded weights)."""
        if self._owner and version != self.version:
            raise WeightsInFlight(f"lease at v{version} while {self.in_flight} sequences of v{self.version} decode")
        self.version = version
        rows = [list(map(int, p)) for p in prompts]
        floor = self._min_shared_prefix
        shared = [] if floor is None else [r for r in rows if len(r) >= max(floor, 2)]
        with mx.stream(self._generator.stream):
            prefilled = _prefill_distinct(self._model, shared, self.batch_size, self._generator.prefill_step_size)
        uids = _insert_groups(self._generator, rows, self.settings.group_size, prefilled)
        number, self._inserted = self._inserted, self._inserted + 1
        self._open[number] = _OpenLease(key, self.settings.group_size, [None] * len(uids))
        for position, uid in enumerate(uids):
            self._owner[uid] = (number, position)
            self._sampled[uid] = ([], [])

    def step(self, on_step: Optional[Callable[[], None]] = None) -> list[FinishedLease[Key]]:
        """One decoding step of every active row; the leases it finished, in the order they finished."""
        if self.idle:
            return []
        responses = self._generator.next_generated()
        if on_step is not None:
            on_step()
        if not responses:
            raise RuntimeError(f"generation stopped with {self.in_flight} sequences unfinished")
        self.usage.count(len(responses))
        finished: list[FinishedLease[Key]] = []
        for response, value in zip(responses, _sampled_logprobs(responses)):
            tokens, logprobs = self._sampled[response.uid]
            tokens.append(int(response.token))
            logprobs.append(value)
            if response.finish_reason is not None:
                done = self._finish(response.uid, GeneratedCompletion(tokens, logprobs, response.finish_reason))
                if done is not None:
                    finished.append(done)
        return finished

    def close(self) -> None:
        self._generator.close()

    def _finish(self, uid: int, completion: GeneratedCompletion) -> Optional[FinishedLease[Key]]:
        number, position = self._owner.pop(uid)
        del self._sampled[uid]
        lease = self._open[number]
        lease.completions[position] = completion
        lease.left -= 1
        if lease.left:
            return None
        del self._open[number]
        return FinishedLease(lease.key, self.version, lease.groups())
