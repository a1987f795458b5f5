"""Which key owns which actor id in this run: the first key that says Hello with an id keeps it.

Without it, any allowed key could say Hello under another actor's id (or its
routing id), take over its registration, and the two would take it back from
each other for the rest of the run. A binding lasts the whole run, resumes
included (it is saved with the learner state); a restarted actor with its own
key gets its id back, and another key is refused `id_taken`. Without CURVE the
key is the routing id itself, so an id stays with the routing id that first
used it.

Bindings are bounded per key and in all, and a key's Hellos never free another
key's ids: beyond `per_key` bindings (IDS_PER_SESSION per session the key may
open) a key's own oldest binding not in use is forgotten (actors named host-pid
take a new id at every restart). Beyond MAX_BOUND_IDS in all, which one key
cannot reach alone, the oldest binding not in use of the key holding the most
goes. A binding in use is never forgotten: when nothing can go, the Hello is
refused.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

# Ids bound at most in one run; a Hello under a new id beyond them is refused.
MAX_BOUND_IDS = 4096
# Names a key may bind per session it may open: each session's actor id and routing id, and as many again for
# sessions restarting under new ids.
IDS_PER_SESSION = 4

InUse = Callable[[str], bool]


class ActorIds:
    """Actor id (and routing id) -> the key that first used it. Thread-safe: read off the I/O thread too."""

    def __init__(self, bound: Optional[dict[str, str]] = None) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, str] = dict(bound or {})  # oldest binding first

    def claim(self, names: list[str], key: str, in_use: InUse = lambda name: True,
              per_key: int = MAX_BOUND_IDS) -> Optional[str]:
        """Bind every one of `names` to `key`, or none of them; the name another key owns (or that no more names
        fit), else None. `in_use(name)`: whether a live actor goes by it (its binding is never forgotten)."""
        with self._lock:
            for name in names:
                owner = self._owner.get(name)
                if owner is not None and owner != key:
                    return name
            new = [name for name in dict.fromkeys(names) if name not in self._owner]
            if not new:
                return None
            going = self._room_for(key, len(new), in_use, per_key)
            if going is None:
                return new[0]
            for name in going:
                del self._owner[name]
            self._owner.update((name, key) for name in new)
            return None

    def _room_for(self, key: str, count: int, in_use: InUse, per_key: int) -> Optional[list[str]]:
        """The bindings to forget so that `count` more of `key`'s fit, or None if they cannot."""
        mine = [name for name, owner in self._owner.items() if owner == key]
        going = oldest_idle(mine, len(mine) + count - per_key, in_use)
        if going is None:
            return None
        excess = len(self._owner) - len(going) + count - MAX_BOUND_IDS
        if excess <= 0:
            return going
        left = {name: owner for name, owner in self._owner.items() if name not in going}
        more = idle_of_largest_holders(left, excess, in_use)
        return None if more is None else going + more

    def owner(self, name: str) -> Optional[str]:
        with self._lock:
            return self._owner.get(name)

    def bindings(self) -> dict[str, str]:
        """A copy, for a checkpoint."""
        with self._lock:
            return dict(self._owner)

    def load(self, bound: dict[str, str]) -> None:
        """Replace the bindings with a checkpoint's (in place: the registry holds this object)."""
        with self._lock:
            self._owner = dict(bound)

    def __len__(self) -> int:
        return len(self._owner)


def oldest_idle(names: list[str], count: int, in_use: InUse) -> Optional[list[str]]:
    """The first `count` of `names` (oldest first) no live actor goes by; None if fewer are idle."""
    if count <= 0:
        return []
    idle = [name for name in names if not in_use(name)][:count]
    return idle if len(idle) == count else None


def idle_of_largest_holders(owners: dict[str, str], count: int, in_use: InUse) -> Optional[list[str]]:
    """`count` bindings not in use, taken oldest first from the keys that hold the most (so a flooding key pays
    before one with a binding or two); None if fewer are idle."""
    held: dict[str, list[str]] = {}
    for name, owner in owners.items():
        held.setdefault(owner, []).append(name)
    going: list[str] = []
    for names in sorted(held.values(), key=len, reverse=True):  # stable: among equals, the key bound first
        going += [name for name in names if not in_use(name)][:count - len(going)]
        if len(going) == count:
            return going
    return None
