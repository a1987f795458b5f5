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

import time
import uuid
from collections.abc import Iterator, Set
from typing import Callable, Optional

from grpo_fleet.learner.records.lease_ledger import LeaseLedger
from grpo_fleet.learner.records.prompt_queue import PromptQueue, group_id_of, serial_of
from grpo_fleet.learner.records.tickets import GroupTicket, LeaseRecord
from grpo_fleet.protocol.reasons import RejectReason

__all__ = ["UNSCORED_KEYS", "UNSCORED_RETURNS", "FinishedGroups", "PromptScheduler", "UnscoredReturns",
           "group_id_of", "serial_of"]

# A prompt whose groups come back unscored this many times in a row is given up on for this pass over the data: a
# reward that always fails on it would otherwise have the fleet regenerate it for ever...
UNSCORED_RETURNS = 3
# ... once they came from this many keys (or every live key, if fewer): one key's returns skip nothing.
UNSCORED_KEYS = 2


class FinishedGroups(Set[str]):
    """The finished group ids, derived (see the module's docstring): handed out, and not live."""

    def __init__(self, queue: PromptQueue, ledger: LeaseLedger) -> None:
        self._queue = queue
        self._ledger = ledger

    def is_live(self, group_id: str) -> bool:
        """Whether a group is out under a lease or queued to go out again (a handed-out id that is not, finished)."""
        return bool(self._ledger.holder(group_id)) or self._queue.holds(group_id)

    def live_ids(self) -> set[str]:
        return self._ledger.ids() | self._queue.ids()

    def __contains__(self, group_id: object) -> bool:
        serial = serial_of(group_id) if isinstance(group_id, str) else None
        return serial is not None and 1 <= serial <= self._queue.last_serial \
            and not self.is_live(group_id)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        """Every finished id, oldest first: for audits and tests (it walks the whole run)."""
        live = self.live_ids()
        return (gid for gid in map(group_id_of, range(1, self._queue.last_serial + 1)) if gid not in live)

    def __len__(self) -> int:
        return self._queue.last_serial - len(self.live_ids())


class UnscoredReturns:
    """Per prompt, the keys that sent its latest groups back unscored in a row: when a prompt is given up on.

    Not checkpointed: a resume forgives.
    """

    def __init__(self) -> None:
        self._keys: dict[int, list[str]] = {}

    def give_up(self, prompt_index: int, key: str, live_keys: int) -> bool:
        """Count one more unscored return of the prompt from `key`: True if the prompt is given up on for the
        pass (its last UNSCORED_RETURNS came back unscored from UNSCORED_KEYS keys, or every live one)."""
        returns = self._keys[prompt_index] = [*self._keys.get(prompt_index, []), key][-UNSCORED_RETURNS:]
        return len(returns) == UNSCORED_RETURNS and len(set(returns)) >= min(UNSCORED_KEYS, live_keys)

    def forget(self, prompt_index: int) -> None:
        """A group of the prompt was accepted: its run of unscored returns is broken."""
        self._keys.pop(prompt_index, None)


class PromptScheduler:
    """Hands out prompts under leases, re-queues expired ones, tracks finished groups.

    Its jobs sit in collaborators: `queue` (the pass order and the groups going out again), `ledger` (open and
    late leases), `unscored` (when a prompt is given up on) and `finished` (derived from the first two).
    """

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
        self.queue = PromptQueue(num_prompts, seed=seed)
        self.ledger = LeaseLedger()
        self.unscored = UnscoredReturns()
        self.finished = FinishedGroups(self.queue, self.ledger)

    @property
    def outstanding_groups(self) -> int:
        return self.ledger.outstanding

    # ------------------------------------------------------------------ handing out

    def issue(self, actor: str, max_groups: int) -> Optional[LeaseRecord]:
        """Lease up to `max_groups` groups to `actor`; re-queued groups go first."""
        if max_groups < 1:
            return None
        now = self.clock()
        lease = LeaseRecord(lease_id=uuid.uuid4().hex, actor=actor, deadline=now + self.lease_seconds, issued_at=now)
        for _ in range(max_groups):
            ticket = self.queue.next_for(actor)
            lease.tickets[ticket.group_id] = ticket
        self.ledger.open(lease)
        return lease

    # ------------------------------------------------------------------ returning

    def classify(self, actor: str, lease_id: str, group_id: str) -> Optional[RejectReason]:
        """Why a submitted group cannot be accepted (DUPLICATE, STALE_LEASE, NOT_YOUR_LEASE, NOT_LEASED), or None.

        A lease that went back lately (expired, or its actor dropped) is judged as an open one: its unfinished groups
        may still be accepted from the actor it was leased to, wherever they are now (queued, or out again: the first
        result wins).
        """
        if group_id in self.finished:
            return RejectReason.DUPLICATE
        lease = self.ledger.lease(lease_id)
        if lease is None:
            return RejectReason.STALE_LEASE
        if lease.actor != actor:
            return RejectReason.NOT_YOUR_LEASE
        if group_id not in lease.tickets:
            return RejectReason.NOT_LEASED
        return None

    def leased_prompt(self, lease_id: str, group_id: str) -> int:
        """The prompt index of a group under an open or late lease (one `classify` found nothing wrong with)."""
        lease = self.ledger.lease(lease_id)
        assert lease is not None, "classify found nothing wrong with it"
        return lease.tickets[group_id].prompt_index

    def finish(self, lease_id: str, group_id: str) -> GroupTicket:
        """Mark a group accepted; it will never be handed out again."""
        ticket = self._take(lease_id, group_id)  # neither leased nor queued now: finished (see FinishedGroups)
        self.unscored.forget(ticket.prompt_index)
        return ticket

    def return_unscored(self, lease_id: str, group_id: str, key: str, live_keys: int) -> bool:
        """A group `key` sent back unscored: True if its prompt is given up on for this pass (see UNSCORED_RETURNS
        and UNSCORED_KEYS); else it is re-queued, barred from `key` while another of the `live_keys` may do it."""
        if self.unscored.give_up(self.leased_prompt(lease_id, group_id), key, live_keys):
            self.finish(lease_id, group_id)
            return True
        self.requeue(lease_id, group_id, not_to=key if live_keys > 1 else None)
        return False

    def requeue(self, lease_id: str, group_id: str, *, not_to: Optional[str] = None) -> GroupTicket:
        """Put a leased group back at the front of the queue (stale result, lost actor); `not_to`: an actor that
        must not get it again (its work on it was refused as its fault), so another does it.

        A late lease's group is queued or out again already (it went back when the lease expired): it stays
        where it is, and only its late ticket is spent."""
        if lease_id in self.ledger.leases:
            ticket = self._take(lease_id, group_id)
            self.queue.push(ticket)
        else:
            ticket = self.ledger.late.forget(lease_id, group_id)
        if not_to is not None and not self.ledger.holder(group_id):
            self.queue.bar(group_id, not_to)
        return ticket

    def _take(self, lease_id: str, group_id: str) -> GroupTicket:
        """A group out of its lease; under a late lease, out of wherever it went since (the queue or a new lease)."""
        if lease_id not in self.ledger.leases:
            ticket = self.ledger.late.forget(lease_id, group_id)
            lease_id = self.ledger.holder(group_id)
            if lease_id not in self.ledger.leases:  # not out again: still queued
                self.queue.drop(group_id)
                return ticket
        return self.ledger.take(lease_id, group_id)

    def expire(self) -> list[LeaseRecord]:
        """Re-queue every lease past its deadline; returns the expired leases."""
        now = self.clock()
        expired = [lease for lease in self.ledger.leases.values() if lease.deadline <= now]
        for lease in expired:
            self.release(lease.lease_id)
        return expired

    def release(self, lease_id: str) -> None:
        """Re-queue all groups still out under a lease, and remember it: its actor's result may still come."""
        lease = self.ledger.leases.get(lease_id)
        if lease is None:
            return
        self.ledger.late.remember(
            LeaseRecord(lease.lease_id, lease.actor, lease.deadline, lease.issued_at, dict(lease.tickets)))
        for group_id in list(lease.tickets):
            self.requeue(lease_id, group_id)

    def release_actor(self, actor: str, keep: frozenset[str] = frozenset()) -> int:
        """Re-queue what is leased to an actor that went away, or came back without it; returns the lease count."""
        mine = [lease.lease_id for lease in self.ledger.leases.values()
                if lease.actor == actor and lease.lease_id not in keep]
        for lease_id in mine:
            self.release(lease_id)
        return len(mine)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: cursor, queue, leases, the last serial (the finished groups follow
        from it and the live ones), RNG."""
        queue, ledger = self.queue.state_dict(), self.ledger.state_dict()
        return {"num_prompts": self.num_prompts,
                **{key: queue[key] for key in ("order", "cursor", "epoch", "serial", "requeued")},
                **ledger, "rng": queue["rng"]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; leases restart their deadline on this process's clock."""
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"checkpoint has {state['num_prompts']} prompts, the dataset now has {self.num_prompts}")
        self.queue.load_state_dict(state)
        now = self.clock()
        self.ledger.load_state_dict(state, deadline=now + self.lease_seconds, now=now)
        # A checkpoint from before the finished ids were derived lists them under "finished": they are every
        # handed-out id that is not live, which is what FinishedGroups says already, so the list is not read.
