"""Whether a peer's message is let in, judged on who sent it before a byte of it is decoded.

The CURVE handshake and its allow-list are the doorman's (doorman.py, which owns the ZeroMQ side); this is the
judgement the loop (dispatch.py) makes on each message, and the cut-off of keys revoked since their handshake.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol.auth import KeyRing
from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.learner")


class Admission:
    """Banned peers and revoked keys are dropped; observer keys are told apart; the allow-list reloads live."""

    def __init__(self, keyring: Optional[KeyRing], registry: Registry, metrics: LearnerMetrics,
                 drop_actor: Callable[[bytes], int]) -> None:
        self.keyring, self.registry, self.metrics, self.drop_actor = keyring, registry, metrics, drop_actor
        self.reload_requested = False

    def admits(self, identity: bytes, principal: Optional[str]) -> bool:
        """Drop messages from banned peers and from keys revoked after their handshake."""
        if self.registry.is_banned(peer_key(identity, principal)):
            self.metrics.protocol_errors.labels(reason="banned").inc()
            return False
        if self.keyring is not None and not (principal and self.keyring.allows(principal.encode())):
            self.metrics.auth_failures.labels(reason="revoked").inc()
            self.drop_actor(identity)
            return False
        return True

    def is_observer(self, principal: Optional[str]) -> bool:
        """Whether this CURVE key may only ask for the run's status (`keys add-observer`)."""
        return self.keyring is not None and principal is not None and self.keyring.is_observer(principal.encode())

    def request_reload(self, *_args: object) -> None:
        """SIGHUP's handler: the allow-list is re-read at the next chores (housekeeping.py)."""
        self.reload_requested = True

    def reload_allow_list(self) -> None:
        """SIGHUP or a change in the authorized/ directory: re-read keys, cut off revoked actors."""
        if self.keyring is None:
            return
        changed = self.keyring.reload() if self.reload_requested else self.keyring.reload_if_changed()
        self.reload_requested = False
        if not changed:
            return
        for identity, info in list(self.registry.actors.items()):
            if not self.keyring.allows(info.principal.encode()):
                released = self.drop_actor(identity)
                log.warning("actor %s (%s) revoked; re-queued %d leases", shown(info.actor_id), shown(info.principal), released)
