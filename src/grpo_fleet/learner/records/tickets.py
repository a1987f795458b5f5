"""What a lease holds: one ticket per prompt group, under one actor and a deadline (lease_book.py keeps them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupTicket:
    """One prompt handed out as a group of G completions."""

    group_id: str
    prompt_index: int


@dataclass
class LeaseRecord:
    """Groups leased to one actor with a deadline."""

    lease_id: str
    actor: str
    deadline: float
    issued_at: float = 0.0
    tickets: dict[str, GroupTicket] = field(default_factory=dict)
