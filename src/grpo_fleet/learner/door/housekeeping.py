"""The learner loop's periodic chores, between its polls: a few times a second at most.

Kept apart from the loop (server.py), which only moves bytes: each chore here is a call into the doorman,
admission, the weights in flight or the coordinator, and the notices go out through the `publish` the loop hands in.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from pydantic import BaseModel

from grpo_fleet.learner.actors.registry import is_silent
from grpo_fleet.learner.door.admission import Admission
from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.learner.door.doorman import Doorman
from grpo_fleet.learner.door.weights_in_flight import WeightsInFlight
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.learner")

# How long an actor may stay silent (in heartbeat periods) before its leases are re-queued.
SILENT_HEARTBEATS = 10


class Housekeeping:
    """Connection events counted, the allow-list reloaded, sent weight blobs let go, leases expired, silent actors
    dropped, service discovery refreshed, the heartbeat and each new policy version announced."""

    def __init__(self, learner: Desk, door: Doorman, admission: Admission, weights_in_flight: WeightsInFlight,
                 publish: Callable[[BaseModel], None]) -> None:
        self.learner, self.door, self.admission = learner, door, admission
        self.weights_in_flight, self.publish = weights_in_flight, publish
        self._announced_version = learner.state.version
        self._last = 0.0

    def run(self, metrics_target: Optional[str]) -> None:
        """The chores, if half a second (or a heartbeat period, if shorter) passed since they last ran."""
        now = time.monotonic()
        period = self.learner.cfg.server.heartbeat_seconds
        if now - self._last < min(0.5, period):
            return
        self._last = now
        self.door.count_connection_events()
        self.admission.reload_allow_list()
        self.weights_in_flight.release()
        self.learner.requests.expire_leases()
        self._drop_silent_actors(now, SILENT_HEARTBEATS * period)
        self.learner.requests.refresh_service_discovery(metrics_target)
        state = self.learner.state
        self.publish(m.Heartbeat(actor_id="learner", policy_version=state.version, sent_at=time.time(),
                                 incarnation=state.incarnation))

    def announce_new_version(self) -> None:
        """PolicyUpdated, once per new snapshot."""
        snapshot = self.learner.snapshots.current
        if snapshot.version != self._announced_version:
            self._announced_version = snapshot.version
            self.publish(m.PolicyUpdated(version=snapshot.version, digest=snapshot.digest,
                                         incarnation=self.learner.state.incarnation))

    def _drop_silent_actors(self, now: float, silence: float) -> None:
        load_grace = self.learner.cfg.server.model_load_seconds
        for identity, info in list(self.learner.registry.actors.items()):
            if is_silent(info, now, silence, load_grace):
                released = self.learner.requests.drop_actor(identity)
                log.info("actor %s went silent; re-queued %d leases", shown(info.actor_id), released)
