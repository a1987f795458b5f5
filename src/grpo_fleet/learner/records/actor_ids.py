"""Which key owns which actor id in this run: the first key that says Hello with an id keeps it.

Without it, any allowed key could say Hello under another actor's id (or its
routing id), take over its registration, and the two would take it back from
each other for the rest of the run. A binding lasts the whole run, resumes
included (it is saved with the learner state); a restarted actor with its own
key gets its id back, and another key is refused `id_taken`. Without CURVE the
key is the routing id itself, so an id stays with the routing id that first
used it. At most MAX_BOUND_IDS ids are bound, so keys cannot grow it for ever:
beyond it the oldest binding of an id not in use is forgotten (actors named
host-pid take a new id at every restart); if every one is in use, the Hello is
refused.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

# Ids bound at most in one run; a Hello under a new id beyond them is refused.
MAX_BOUND_IDS = 4096


class ActorIds:
    """Actor id (and routing id) -> the key that first used it. Thread-safe: read off the I/O thread too."""

    def __init__(self, bound: Optional[dict[str, str]] = None) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, str] = dict(bound or {})

    def claim(self, names: list[str], key: str, in_use: Callable[[str], bool] = lambda name: True) -> Optional[str]:
        """Bind every one of `names` to `key`, or none of them; the name another key owns (or that no more names
        fit), else None. `in_use(name)`: whether a live actor goes by it (its binding is never forgotten)."""
        with self._lock:
            for name in names:
                owner = self._owner.get(name)
                if owner is not None and owner != key:
                    return name
            new = [name for name in dict.fromkeys(names) if name not in self._owner]
            excess = len(self._owner) + len(new) - MAX_BOUND_IDS
            if excess > 0:
                idle = [name for name in self._owner if not in_use(name)][:excess]  # oldest first
                if len(idle) < excess:
                    return new[0]
                for name in idle:
                    del self._owner[name]
            self._owner.update((name, key) for name in new)
            return None

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
