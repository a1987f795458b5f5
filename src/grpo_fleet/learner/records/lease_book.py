"""Prompt leases: which prompt groups are out, with whom, until when.

Pure bookkeeping on the learner's own monotonic clock; no sockets. A group keeps
its `group_id` for its whole life (re-queued groups are re-leased under the same
id), so dedup by `group_id` gives exactly-once accounting.

Which groups are finished is not stored: ids are handed out in order (`g00000001`,
`g00000002`, ...), and every id handed out is either still live (under a lease, or
queued again) or finished. So a group is finished when its id was handed out and
is not live, which costs nothing per accepted group: a run of any length keeps
and checkpoints only its live groups and the last serial, and a resume refuses
duplicates exactly as the run did.

An expired (or released) lease is re-queued and remembered (late_leases.py): a
late result for a group still unfinished is taken, the first result for a group
wins, and the other holder's copy is then a duplicate.

A group sent back unscored (its reward failed on the actor) goes back in the
queue barred from the key that returned it, while another key is live, so the
next attempt is another key's: one key cannot choose, by returning prompts
unscored, which ones train. A prompt is given up on for the pass only when its
last UNSCORED_RETURNS groups came back unscored from UNSCORED_KEYS different keys
(from the one key, in a fleet of one).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from collections.abc import Iterator, Set
from typing import Callable, Optional

from grpo_fleet.learner.records.late_leases import LateLeases
from grpo_fleet.learner.records.tickets import GroupTicket, LeaseRecord
from grpo_fleet.protocol.reasons import RejectReason

# A prompt whose groups come back unscored this many times in a row is given up on for this pass over the data: a
# reward that always fails on it would otherwise have the fleet regenerate it for ever...
UNSCORED_RETURNS = 3
# ... once they came from this many keys (or every live key, if fewer): one key's returns skip nothing.
UNSCORED_KEYS = 2


def group_id_of(serial: int) -> str:
    return f"g{serial:08d}"


def serial_of(group_id: str) -> Optional[int]:
    """The serial a group id was made from, or None for a string `group_id_of` never makes."""
    digits = group_id[1:]
    if not (group_id[:1] == "g" and digits.isascii() and digits.isdigit()):
        return None
    serial = int(digits)
    return serial if group_id_of(serial) == group_id else None


class FinishedGroups(Set[str]):
    """The finished group ids, derived (see the module's docstring): handed out, and not live."""

    def __init__(self, scheduler: PromptScheduler) -> None:
        self._scheduler = scheduler

    def __contains__(self, group_id: object) -> bool:
        serial = serial_of(group_id) if isinstance(group_id, str) else None
        return serial is not None and 1 <= serial <= self._scheduler.last_serial \
            and not self._scheduler.is_live(group_id)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        """Every finished id, oldest first: for audits and tests (it walks the whole run)."""
        live = self._scheduler.live_ids()
        return (gid for gid in map(group_id_of, range(1, self._scheduler.last_serial + 1)) if gid not in live)

    def __len__(self) -> int:
        return self._scheduler.last_serial - len(self._scheduler.live_ids())


class PromptScheduler:
    """Hands out prompts under leases, re-queues expired ones, tracks finished groups."""

    def __init__(
        self,
        num_prompts: int,
        *,
        seed: int,
        lease_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_prompts < 1:
            raise ValueError("the dataset has no prompts")
        self.num_prompts = num_prompts
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._cursor = 0
        self.epoch = 0
        self._serial = 0
        self._requeued: deque[GroupTicket] = deque()
        # Re-queued group -> the actor it must not go back to (its work on it was refused as its own fault); not
        # checkpointed: a resume forgives.
        self._not_to: dict[str, str] = {}
        # Prompt index -> the keys of its latest groups sent back unscored in a row (not checkpointed either).
        self._unscored: dict[int, list[str]] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self._lease_of_group: dict[str, str] = {}
        self.late = LateLeases()  # leases re-queued (expired, or their actor dropped) whose result may still come
        self.finished = FinishedGroups(self)

    # ------------------------------------------------------------------ handing out

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

    @property
    def last_serial(self) -> int:
        """The serial of the last group id handed out (0 before the first)."""
        return self._serial

    def is_live(self, group_id: str) -> bool:
        """Whether a group is out under a lease or queued to go out again (a handed-out id that is not, finished)."""
        return group_id in self._lease_of_group or any(t.group_id == group_id for t in self._requeued)

    def live_ids(self) -> set[str]:
        return set(self._lease_of_group) | {t.group_id for t in self._requeued}

    @property
    def outstanding_groups(self) -> int:
        return len(self._lease_of_group)

    def groups_held(self, actor: str) -> int:
        """Groups out under `actor`'s leases."""
        return sum(len(lease.tickets) for lease in self.leases.values() if lease.actor == actor)

    @property
    def queued_groups(self) -> list[GroupTicket]:
        return list(self._requeued)

    def issue(self, actor: str, max_groups: int) -> Optional[LeaseRecord]:
        """Lease up to `max_groups` groups to `actor`; re-queued groups go first."""
        if max_groups < 1:
            return None
        now = self.clock()
        lease = LeaseRecord(lease_id=uuid.uuid4().hex, actor=actor, deadline=now + self.lease_seconds, issued_at=now)
        for _ in range(max_groups):
            ticket = self._next_requeued(actor) or self._next_fresh()
            lease.tickets[ticket.group_id] = ticket
            self._lease_of_group[ticket.group_id] = lease.lease_id
        self.leases[lease.lease_id] = lease
        return lease

    def _next_requeued(self, actor: str) -> Optional[GroupTicket]:
        """The oldest re-queued group `actor` may have (not one its own fault sent back), out of the queue."""
        for position, ticket in enumerate(self._requeued):
            if self._not_to.get(ticket.group_id) != actor:
                del self._requeued[position]
                self._not_to.pop(ticket.group_id, None)
                return ticket
        return None

    # ------------------------------------------------------------------ returning

    def classify(self, actor: str, lease_id: str, group_id: str) -> Optional[RejectReason]:
        """Why a submitted group cannot be accepted (DUPLICATE, STALE_LEASE, NOT_YOUR_LEASE, NOT_LEASED), or None.

        A lease that went back lately (expired, or its actor dropped) is judged as an open one: its unfinished groups
        may still be accepted from the actor it was leased to, wherever they are now (queued, or out again: the first
        result wins).
        """
        if group_id in self.finished:
            return RejectReason.DUPLICATE
        lease = self._lease(lease_id)
        if lease is None:
            return RejectReason.STALE_LEASE
        if lease.actor != actor:
            return RejectReason.NOT_YOUR_LEASE
        if group_id not in lease.tickets:
            return RejectReason.NOT_LEASED
        return None

    def leased_prompt(self, lease_id: str, group_id: str) -> int:
        """The prompt index of a group under an open or late lease (one `classify` found nothing wrong with)."""
        lease = self._lease(lease_id)
        assert lease is not None, "classify found nothing wrong with it"
        return lease.tickets[group_id].prompt_index

    def is_late(self, lease_id: str) -> bool:
        """Whether `lease_id` names a lease that went back and is remembered (late_leases.py), not an open one."""
        return lease_id not in self.leases and self.late.get(lease_id) is not None

    def _lease(self, lease_id: str) -> Optional[LeaseRecord]:
        """An open lease, or one that went back lately."""
        return self.leases.get(lease_id) or self.late.get(lease_id)

    def finish(self, lease_id: str, group_id: str) -> GroupTicket:
        """Mark a group accepted; it will never be handed out again."""
        ticket = self._take(lease_id, group_id)  # neither leased nor queued now: finished (see FinishedGroups)
        self._unscored.pop(ticket.prompt_index, None)
        return ticket

    def return_unscored(self, lease_id: str, group_id: str, key: str, live_keys: int) -> bool:
        """A group `key` sent back unscored: True if its prompt is given up on for this pass (see UNSCORED_RETURNS
        and UNSCORED_KEYS); else it is re-queued, barred from `key` while another of the `live_keys` may do it."""
        index = self.leased_prompt(lease_id, group_id)
        returns = self._unscored[index] = [*self._unscored.get(index, []), key][-UNSCORED_RETURNS:]
        if len(returns) == UNSCORED_RETURNS and len(set(returns)) >= min(UNSCORED_KEYS, live_keys):
            self.finish(lease_id, group_id)
            return True
        self.requeue(lease_id, group_id, not_to=key if live_keys > 1 else None)
        return False

    def requeue(self, lease_id: str, group_id: str, *, not_to: Optional[str] = None) -> GroupTicket:
        """Put a leased group back at the front of the queue (stale result, lost actor); `not_to`: an actor that
        must not get it again (its work on it was refused as its fault), so another does it.

        A late lease's group is queued or out again already (it went back when the lease expired): it stays
        where it is, and only its late ticket is spent."""
        if lease_id in self.leases:
            ticket = self._take(lease_id, group_id)
            self._requeued.append(ticket)
        else:
            ticket = self.late.forget(lease_id, group_id)
        if not_to is not None and group_id not in self._lease_of_group:
            self._not_to[group_id] = not_to
        return ticket

    def retry_prompt(self, prompt_index: int) -> GroupTicket:
        """Queue an accepted group's prompt again as a new group (its old group id stays finished)."""
        self._serial += 1
        ticket = GroupTicket(group_id=group_id_of(self._serial), prompt_index=prompt_index)
        self._requeued.append(ticket)
        return ticket

    def _take(self, lease_id: str, group_id: str) -> GroupTicket:
        """A group out of its lease; under a late lease, out of wherever it went since (the queue or a new lease)."""
        if lease_id not in self.leases:
            ticket = self.late.forget(lease_id, group_id)
            lease_id = self._lease_of_group.get(group_id, "")
            if lease_id not in self.leases:  # not out again: still queued
                self._requeued = deque(t for t in self._requeued if t.group_id != group_id)
                self._not_to.pop(group_id, None)
                return ticket
        lease = self.leases[lease_id]
        ticket = lease.tickets.pop(group_id)
        self._lease_of_group.pop(group_id, None)
        if not lease.tickets:
            del self.leases[lease_id]
        return ticket

    def expire(self) -> list[LeaseRecord]:
        """Re-queue every lease past its deadline; returns the expired leases."""
        now = self.clock()
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            self.release(lease.lease_id)
        return expired

    def release(self, lease_id: str) -> None:
        """Re-queue all groups still out under a lease, and remember it: its actor's result may still come."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        self.late.remember(LeaseRecord(lease.lease_id, lease.actor, lease.deadline, lease.issued_at, dict(lease.tickets)))
        for group_id in list(lease.tickets):
            self.requeue(lease_id, group_id)

    def release_actor(self, actor: str, keep: frozenset[str] = frozenset()) -> int:
        """Re-queue what is leased to an actor that went away, or came back without it; returns the lease count."""
        mine = [lease.lease_id for lease in self.leases.values() if lease.actor == actor and lease.lease_id not in keep]
        for lease_id in mine:
            self.release(lease_id)
        return len(mine)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: cursor, queue, leases, the last serial (the finished groups follow
        from it and the live ones), RNG."""
        version, internal, gauss = self._rng.getstate()
        return {
            "num_prompts": self.num_prompts,
            "order": list(self._order),
            "cursor": self._cursor,
            "epoch": self.epoch,
            "serial": self._serial,
            "requeued": [[t.group_id, t.prompt_index] for t in self._requeued],
            "leases": [_lease_entry(lease) for lease in self.leases.values()],
            "late": [_lease_entry(lease) for lease in self.late.records()],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; leases restart their deadline on this process's clock."""
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"checkpoint has {state['num_prompts']} prompts, the dataset now has {self.num_prompts}")
        self._order = list(state["order"])
        self._cursor = state["cursor"]
        self.epoch = state["epoch"]
        self._serial = state["serial"]
        self._requeued = deque(GroupTicket(g, i) for g, i in state["requeued"])
        self._not_to = {}
        self.leases, self._lease_of_group = {}, {}
        deadline = self.clock() + self.lease_seconds
        for entry in state["leases"]:
            lease = _lease_of(entry, deadline, self.clock())
            self._lease_of_group.update(dict.fromkeys(lease.tickets, lease.lease_id))
            self.leases[lease.lease_id] = lease
        self.late = LateLeases()  # a checkpoint from before late leases were kept has none
        for entry in state.get("late", []):
            self.late.remember(_lease_of(entry, self.clock(), self.clock()))
        # A checkpoint from before the finished ids were derived lists them under "finished": they are every
        # handed-out id that is not live, which is what FinishedGroups says already, so the list is not read.
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def _lease_entry(lease: LeaseRecord) -> dict:
    """A lease as its checkpoint holds it (the deadline restarts on resume, so it is not kept)."""
    return {"lease_id": lease.lease_id, "actor": lease.actor,
            "tickets": [[t.group_id, t.prompt_index] for t in lease.tickets.values()]}


def _lease_of(entry: dict, deadline: float, issued_at: float) -> LeaseRecord:
    """`_lease_entry`'s record back, with its deadline on this process's clock."""
    tickets = {group_id: GroupTicket(group_id, index) for group_id, index in entry["tickets"]}
    return LeaseRecord(lease_id=entry["lease_id"], actor=entry["actor"], deadline=deadline, issued_at=issued_at,
                       tickets=tickets)
