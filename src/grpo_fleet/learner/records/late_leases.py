"""Leases that expired lately: whose they were and which groups they still held, so a late result can count.

A long answer can outlive `server.lease_seconds`, or its actor can go silent for
a while and be dropped. The scheduler re-queues such a lease's groups at once
(another actor may do them), and remembers the lease here. A result that then
arrives from the same actor, for a group that is still unfinished, is taken as if
the lease were open (the first result for a group wins; see
PromptScheduler.classify). Only the tickets a lease held when it went back are
kept, each under the actor it was leased to, so a late result can name no group
its sender never held; a ticket is forgotten once its group is answered, so it
counts once. The count of leases kept is bounded (oldest out), and so is the
memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from grpo_fleet.learner.records.tickets import GroupTicket, LeaseRecord

# Leases kept after they expired: each holds at most server.max_groups_per_lease tickets. At one expiry a second
# this reaches back about 17 minutes, far longer than a late result takes to arrive.
LATE_LEASES_KEPT = 1024


class LateLeases:
    """Expired leases by id, oldest forgotten first past `capacity`; no clock, no sockets."""

    def __init__(self, capacity: int = LATE_LEASES_KEPT) -> None:
        self.capacity = capacity
        self._leases: OrderedDict[str, LeaseRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    def remember(self, lease: LeaseRecord) -> None:
        """Keep `lease` (a copy of it as it expired, tickets included); the oldest goes past the capacity."""
        if not lease.tickets:
            return
        self._leases[lease.lease_id] = lease
        while len(self._leases) > self.capacity:
            self._leases.popitem(last=False)

    def get(self, lease_id: str) -> Optional[LeaseRecord]:
        return self._leases.get(lease_id)

    def forget(self, lease_id: str, group_id: str) -> GroupTicket:
        """Take one answered group's ticket out (its result has come back); a lease with none left goes."""
        lease = self._leases[lease_id]
        ticket = lease.tickets.pop(group_id)
        if not lease.tickets:
            del self._leases[lease_id]
        return ticket

    def records(self) -> list[LeaseRecord]:
        """The leases kept, oldest first (for the checkpoint)."""
        return list(self._leases.values())
