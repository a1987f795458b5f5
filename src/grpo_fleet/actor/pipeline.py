"""In flight on the actor's pipelined link: the prefetched lease, the unacknowledged submission, which Ack answers it.

Plain bookkeeping, no sockets. The worker asks for its next lease before it
generates the current one, and sends a submission without waiting for its Ack;
at most one lease request and one submission are ever unanswered, and the
learner answers in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo_fleet.protocol import messages as m


@dataclass
class InFlight:
    """The work an actor holds between requests; what survives a reconnect to the same run."""

    submitted: Optional[m.Rollouts] = None  # sent, Ack not yet read
    next_lease: Optional[m.Lease] = None  # answered, not yet generated
    lease_requested: bool = False  # a LeaseRequest is unanswered

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

    def forget(self) -> None:
        """Another run: its leases, and the work done for them, mean nothing there."""
        self.submitted = self.next_lease = None

    def holding(self) -> list[str]:
        """Leases this actor still means to deliver, for Hello after a reconnect."""
        return [work.lease_id for work in (self.submitted, self.next_lease) if work is not None and work.lease_id]

    @property
    def drained(self) -> bool:
        """Nothing leased, generated or asked for is left to deliver."""
        return self.submitted is None and self.next_lease is None and not self.lease_requested
