"""The open leases, the late ones, and which open lease holds each group.

Kept apart from the pass order (prompt_queue.py): this is who has what, until when; that is what goes out next.
"""

from __future__ import annotations

from typing import Optional

from grpo_fleet.learner.records.late_leases import LateLeases
from grpo_fleet.learner.records.tickets import GroupTicket, LeaseRecord


class LeaseLedger:
    """Open leases by id, the groups out under each, and the late leases (gone back; their result may still come)."""

    def __init__(self) -> None:
        self.leases: dict[str, LeaseRecord] = {}
        self._lease_of_group: dict[str, str] = {}
        self.late = LateLeases()  # leases re-queued (expired, or their actor dropped) whose result may still come

    def open(self, lease: LeaseRecord) -> None:
        self.leases[lease.lease_id] = lease
        self._lease_of_group.update(dict.fromkeys(lease.tickets, lease.lease_id))

    def lease(self, lease_id: str) -> Optional[LeaseRecord]:
        """An open lease, or one that went back lately."""
        return self.leases.get(lease_id) or self.late.get(lease_id)

    def is_late(self, lease_id: str) -> bool:
        """Whether `lease_id` names a lease that went back and is remembered (late_leases.py), not an open one."""
        return lease_id not in self.leases and self.late.get(lease_id) is not None

    def holder(self, group_id: str) -> str:
        """The id of the open lease `group_id` is out under, or "" when it is not out."""
        return self._lease_of_group.get(group_id, "")

    def ids(self) -> set[str]:
        """The groups out under an open lease."""
        return set(self._lease_of_group)

    @property
    def outstanding(self) -> int:
        return len(self._lease_of_group)

    def groups_held(self, actor: str) -> int:
        """Groups out under `actor`'s leases."""
        return sum(len(lease.tickets) for lease in self.leases.values() if lease.actor == actor)

    def take(self, lease_id: str, group_id: str) -> GroupTicket:
        """A group out of its open lease; a lease left empty is closed."""
        lease = self.leases[lease_id]
        ticket = lease.tickets.pop(group_id)
        self._lease_of_group.pop(group_id, None)
        if not lease.tickets:
            del self.leases[lease_id]
        return ticket

    def state_dict(self) -> dict:
        return {"leases": [_lease_entry(lease) for lease in self.leases.values()],
                "late": [_lease_entry(lease) for lease in self.late.records()]}

    def load_state_dict(self, state: dict, *, deadline: float, now: float) -> None:
        """Restore `state_dict()`; open leases get `deadline` on this process's clock."""
        self.leases, self._lease_of_group = {}, {}
        for entry in state["leases"]:
            self.open(_lease_of(entry, deadline, now))
        self.late = LateLeases()  # a checkpoint from before late leases were kept has none
        for entry in state.get("late", []):
            self.late.remember(_lease_of(entry, now, now))


def _lease_entry(lease: LeaseRecord) -> dict:
    """A lease as its checkpoint holds it (the deadline restarts on resume, so it is not kept)."""
    return {"lease_id": lease.lease_id, "actor": lease.actor,
            "tickets": [[t.group_id, t.prompt_index] for t in lease.tickets.values()]}


def _lease_of(entry: dict, deadline: float, issued_at: float) -> LeaseRecord:
    """`_lease_entry`'s record back, with its deadline on this process's clock."""
    tickets = {group_id: GroupTicket(group_id, index) for group_id, index in entry["tickets"]}
    return LeaseRecord(lease_id=entry["lease_id"], actor=entry["actor"], deadline=deadline, issued_at=issued_at,
                       tickets=tickets)
