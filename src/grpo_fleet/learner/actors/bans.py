"""Violations per peer and the bans they earn: bounded, escalating, and saved with each checkpoint.

The ban policy, in one place:
- Only malformed or hostile input is a violation: a message that fails to decode
  or validate, a request type a learner never answers, rollouts for another
  actor's lease or for groups a lease never held, logprobs or rewards the
  learner does not get. Stale work, duplicates, a version this life of the
  learner never published, and requests from a peer that has not said Hello to
  this life (an honest actor after a learner restart) never count: they are the
  learner's or the network's doing, not the peer's.
- A ban follows the peer's key: its CURVE public key when CURVE is on (an actor
  restarted under another --actor-id is still banned), else its routing id,
  which is its `--actor-id`. Without CURVE a peer picks its routing id freely,
  so a ban there stops a misbehaving actor, not a determined attacker.
- A key's first ban comes after `max_violations` violations (at once for a
  logprob lie) and lasts `ban_seconds`. Bans escalate: each later ban of the same
  key lasts twice the one before (10, 20, 40, 80 minutes at the default), and a
  key that was banned before is on its last warning for the rest of the run:
  its next violation bans it again. Its count of bans lasts the whole run,
  and the logprob check checks every group of such a key (verify/batch_checks.py):
  a liar that comes back gets no probation credit. So a liar that returns
  whenever its ban runs out trains its lies in its first life only.
- Bans and ban counts are saved with each checkpoint (`export` / `load`, the ban's
  end as wall-clock time) and survive `--resume`; time the learner was down
  counts toward a ban. Bans earned after the last checkpoint are lost with a
  crash, as is the rest of that state.
- At most `max_tracked` keys are remembered; beyond that one never banned
  goes first (the least recently offending), so throwaway identities cannot
  grow the learner's memory nor push a banned key out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

# Keys with a violation count; beyond this the least recently offending is forgotten.
MAX_TRACKED_PEERS = 4096
# A ban doubles at most this many times (600 s * 2**16: 455 days), so its end stays a finite float.
MAX_DOUBLINGS = 16


def peer_key(identity: bytes, principal: Optional[str]) -> str:
    """What a ban and a lease are bound to: the CURVE public key (z85) if any, else the routing id in hex."""
    return principal or identity.hex()


@dataclass
class _Record:
    violations: int = 0  # since its last ban ran out
    banned_until: float = 0.0  # on the Bans clock; 0: not banned
    times_banned: int = 0  # in this run


class Bans:
    """Counts violations per key, says whether a key is banned now, and whether it ever was."""

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
            entry.violations, entry.banned_until = 0, 0.0  # the ban ran out; it still counts as one
        entry.violations += weight
        limit = 1 if entry.times_banned else self.max_violations  # banned before: the last warning was that ban
        newly_banned = entry.violations >= limit and not entry.banned_until
        if newly_banned:
            entry.times_banned += 1
            entry.banned_until = now + self.length(entry.times_banned)
        self._records[key] = entry  # most recent last
        self._trim()
        return newly_banned

    def length(self, times_banned: int) -> float:
        """How long the `times_banned`-th ban of a key lasts: ban_seconds, doubled for each ban before it."""
        return self.ban_seconds * 2.0 ** min(max(times_banned - 1, 0), MAX_DOUBLINGS)

    def is_banned(self, key: str) -> bool:
        entry = self._records.get(key)
        return entry is not None and entry.banned_until > self.clock()

    def times_banned(self, key: str) -> int:
        """How many bans `key` has earned in this run (0: never banned)."""
        entry = self._records.get(key)
        return 0 if entry is None else entry.times_banned

    def violations(self, key: str) -> int:
        entry = self._records.get(key)
        return 0 if entry is None else entry.violations

    def banned_count(self) -> int:
        now = self.clock()
        return sum(entry.banned_until > now for entry in self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def export(self, wall: float) -> dict[str, list[float]]:
        """Every key's [violations, times banned, end of its ban as wall-clock time at `wall` (0: none)], for a
        checkpoint."""
        now = self.clock()
        out: dict[str, list[float]] = {}
        for key, entry in self._records.items():
            over = 0 < entry.banned_until <= now  # ran out: its count starts again at the next violation
            left = entry.banned_until - now if entry.banned_until > now else 0.0
            out[key] = [0 if over else entry.violations, entry.times_banned, wall + left if left else 0.0]
        return out

    def load(self, saved: dict[str, list[float]], wall: float) -> None:
        """Take back what `export` wrote (at wall-clock `wall` now): a ban whose end passed meanwhile is over, its
        count of bans kept."""
        now = self.clock()
        self._records.clear()
        for key, (violations, times_banned, until) in saved.items():
            left = until - wall if until else 0.0
            if until and left <= 0:  # the ban ran out while the learner was down: a fresh count, the ban still counted
                violations = 0
            self._records[key] = _Record(int(violations), now + left if left > 0 else 0.0, int(times_banned))
        self._trim()

    def _trim(self) -> None:
        """Forget keys beyond max_tracked: first the least recently offending never banned, then any."""
        while len(self._records) > self.max_tracked:
            spare = next((key for key, e in self._records.items() if not e.times_banned), None)
            if spare is None:
                self._records.popitem(last=False)
            else:
                del self._records[spare]
