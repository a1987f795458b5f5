"""In flight on the actor's pipelined link: the prefetched lease, the unacknowledged submission, which Ack answers it.

Plain bookkeeping, no sockets. The worker asks for its next lease before it
generates the current one, and sends a submission without waiting for its Ack;
at most one lease request and one submission are ever unanswered, and the
learner answers in order. In the rolling batch (actor/streaming.py) several
leases decode at once and finish in any order: those are `generating`, and the
finished ones wait in `finished` for the one submission in flight to be answered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from grpo_fleet.protocol import messages as m


@dataclass
class InFlight:
    """The work an actor holds between requests; what survives a reconnect to the same run."""

    submitted: Optional[m.Rollouts] = None  # sent, Ack not yet read
    next_lease: Optional[m.Lease] = None  # answered, not yet generated
    lease_requested: bool = False  # a LeaseRequest is unanswered
    generating: set[str] = field(default_factory=set)  # lease ids decoding in the rolling batch
    finished: deque[m.Rollouts] = field(default_factory=deque)  # scored, to send once `submitted` is answered

    def book_lease(self, lease: m.Lease) -> None:
        """The answer to the lease request: the lease to generate next."""
        self.next_lease, self.lease_requested = lease, False

    def take_lease(self) -> Optional[m.Lease]:
        """Hand over the prefetched lease (None if there is none)."""
        lease, self.next_lease = self.next_lease, None
        return lease

    def pair_ack(self, ack: m.Ack) -> Optional[m.Rollouts]:
        """The submission `ack` answers (by lease_id), now settled; None if it answers none awaiting.

        A stray Ack (a late answer to a submission already settled over an
        older connection) leaves the one awaiting its own answer untouched.
        """
        if self.submitted is None or ack.lease_id != self.submitted.lease_id:
            return None
        answered, self.submitted = self.submitted, None
        return answered

    def new_connection(self) -> None:
        """A new socket: answers to the old one's requests are gone (the submission is resent)."""
        self.lease_requested = False

    def submit_next(self) -> Optional[m.Rollouts]:
        """The next finished lease to send, now that no submission awaits its answer (None: none, or one awaits)."""
        if self.submitted is not None or not self.finished:
            return None
        self.submitted = self.finished.popleft()
        return self.submitted

    def forget(self) -> None:
        """Another run: its leases, and the work done for them, mean nothing there."""
        self.submitted = self.next_lease = None
        self.generating.clear()
        self.finished.clear()

    def holding(self) -> list[str]:
        """Leases this actor still means to deliver, for Hello after a reconnect."""
        work = [self.submitted, self.next_lease, *self.finished]
        return [w.lease_id for w in work if w is not None and w.lease_id] + sorted(self.generating)

    @property
    def drained(self) -> bool:
        """Nothing leased, generated or asked for is left to deliver."""
        return (self.submitted is None and self.next_lease is None and not self.lease_requested
                and not self.generating and not self.finished)
