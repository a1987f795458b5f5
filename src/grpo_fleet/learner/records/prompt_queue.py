"""The order groups go out in: a shuffled pass over the dataset, behind a queue of groups going out again.

A group's id is made from a serial handed out in order (`g00000001`, `g00000002`, ...), which is what lets
the lease book derive the finished groups instead of storing them (lease_book.py).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Optional

from grpo_fleet.learner.records.tickets import GroupTicket


def group_id_of(serial: int) -> str:
    return f"g{serial:08d}"


def serial_of(group_id: str) -> Optional[int]:
    """The serial a group id was made from, or None for a string `group_id_of` never makes."""
    digits = group_id[1:]
    if not (group_id[:1] == "g" and digits.isascii() and digits.isdigit()):
        return None
    serial = int(digits)
    return serial if group_id_of(serial) == group_id else None


class PromptQueue:
    """Which group an actor gets next: a re-queued one first (unless barred from it), else the pass's next prompt.

    Kept apart from the leases so that the pass order and its checkpoint can be read alone.
    """

    def __init__(self, num_prompts: int, *, seed: int) -> None:
        self.num_prompts = num_prompts
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._cursor = 0
        self.epoch = 0
        self._serial = 0
        self._requeued: deque[GroupTicket] = deque()
        # Re-queued group -> the actor it must not go back to (its work on it was refused as its own fault); not
        # checkpointed: a resume forgives.
        self._not_to: dict[str, str] = {}

    @property
    def last_serial(self) -> int:
        """The serial of the last group id handed out (0 before the first)."""
        return self._serial

    @property
    def tickets(self) -> list[GroupTicket]:
        """The groups queued to go out again, oldest first."""
        return list(self._requeued)

    def holds(self, group_id: str) -> bool:
        return any(t.group_id == group_id for t in self._requeued)

    def ids(self) -> set[str]:
        return {t.group_id for t in self._requeued}

    def next_for(self, actor: str) -> GroupTicket:
        """The next group for `actor`: the oldest re-queued one it may have, else a fresh one."""
        return self._next_requeued(actor) or self._next_fresh()

    def _next_fresh(self) -> GroupTicket:
        if self._cursor >= len(self._order):
            self._order = list(range(self.num_prompts))
            self._rng.shuffle(self._order)
            self._cursor = 0
            self.epoch += 1
        index = self._order[self._cursor]
        self._cursor += 1
        self._serial += 1
        return GroupTicket(group_id=group_id_of(self._serial), prompt_index=index)

    def _next_requeued(self, actor: str) -> Optional[GroupTicket]:
        """The oldest re-queued group `actor` may have (not one its own fault sent back), out of the queue."""
        for position, ticket in enumerate(self._requeued):
            if self._not_to.get(ticket.group_id) != actor:
                del self._requeued[position]
                self._not_to.pop(ticket.group_id, None)
                return ticket
        return None

    def push(self, ticket: GroupTicket) -> None:
        self._requeued.append(ticket)

    def bar(self, group_id: str, actor: str) -> None:
        """`actor` must not get `group_id` again (its work on it was refused as its fault), so another does it."""
        self._not_to[group_id] = actor

    def drop(self, group_id: str) -> None:
        """A queued group out of the queue (a late result for it was taken)."""
        self._requeued = deque(t for t in self._requeued if t.group_id != group_id)
        self._not_to.pop(group_id, None)

    def retry_prompt(self, prompt_index: int) -> GroupTicket:
        """Queue an accepted group's prompt again as a new group (its old group id stays finished)."""
        self._serial += 1
        ticket = GroupTicket(group_id=group_id_of(self._serial), prompt_index=prompt_index)
        self._requeued.append(ticket)
        return ticket

    def state_dict(self) -> dict:
        """The pass order, cursor, last serial, queue and RNG (the bars are not kept: a resume forgives)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "order": list(self._order),
            "cursor": self._cursor,
            "epoch": self.epoch,
            "serial": self._serial,
            "requeued": [[t.group_id, t.prompt_index] for t in self._requeued],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` (extra keys, the lease book's, are ignored)."""
        self._order = list(state["order"])
        self._cursor = state["cursor"]
        self.epoch = state["epoch"]
        self._serial = state["serial"]
        self._requeued = deque(GroupTicket(g, i) for g, i in state["requeued"])
        self._not_to = {}
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
