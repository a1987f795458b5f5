"""Violations per peer and the bans they earn: bounded, on the learner's own clock.

The ban policy, in one place:
- Only malformed or hostile input is a violation: a message that fails to decode
  or validate, a request type a learner never answers, rollouts for another
  actor's lease or for groups a lease never held. Stale work, duplicates, a
  version this life of the learner never published, and requests from a peer
  that has not said Hello to this life (an honest actor after a learner restart)
  never count: they are the learner's or the network's doing, not the peer's.
- A ban follows the peer's key: its CURVE public key when CURVE is on (an actor
  restarted under another --actor-id is still banned), else its routing id,
  which is its `--actor-id`. Without CURVE a peer picks its routing id freely,
  so a ban there stops a misbehaving actor, not a determined attacker.
- After `max_violations` violations the key is ignored for `ban_seconds`; then
  its count starts again from zero. Bans live in memory only, so a learner
  restart lifts them.
- At most `max_tracked` keys are remembered (oldest first out), so a flood of
  throwaway identities cannot grow the learner's memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

# Keys with a violation count; beyond this the least recently offending is forgotten.
MAX_TRACKED_PEERS = 4096


def peer_key(identity: bytes, principal: Optional[str]) -> str:
    """What a ban and a lease are bound to: the CURVE public key (z85) if any, else the routing id in hex."""
    return principal or identity.hex()


@dataclass
class _Record:
    violations: int = 0
    banned_until: float = 0.0


class Bans:
    """Counts violations per key and says whether a key is currently banned."""

    def __init__(
        self,
        max_violations: int,
        ban_seconds: float,
        *,
        max_tracked: int = MAX_TRACKED_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_violations = max_violations
        self.ban_seconds = ban_seconds
        self.max_tracked = max_tracked
        self.clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def record(self, key: str, weight: int = 1) -> bool:
        """Count `weight` violations by `key` (max_violations bans at once); True when this bans it."""
        now = self.clock()
        entry = self._records.pop(key, None) or _Record()
        if entry.banned_until and entry.banned_until <= now:
            entry = _Record()  # the ban ran out: a fresh start
        entry.violations += weight
        newly_banned = entry.violations >= self.max_violations and not entry.banned_until
        if newly_banned:
            entry.banned_until = now + self.ban_seconds
        self._records[key] = entry  # most recent last
        while len(self._records) > self.max_tracked:
            self._records.popitem(last=False)
        return newly_banned

    def is_banned(self, key: str) -> bool:
        entry = self._records.get(key)
        return entry is not None and entry.banned_until > self.clock()

    def violations(self, key: str) -> int:
        entry = self._records.get(key)
        return 0 if entry is None else entry.violations

    def banned_count(self) -> int:
        now = self.clock()
        return sum(entry.banned_until > now for entry in self._records.values())

    def __len__(self) -> int:
        return len(self._records)
