"""What the learner's ZeroMQ loop (server.py, doorman.py) needs of the run: the one seam between the door and
the run's coordinator above it (learner/run/coordinator.py), so the door imports nothing from that floor."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Protocol

from pydantic import BaseModel

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.verify.verification import Verification
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError


class RequestDesk(Protocol):
    """The I/O thread's part of the run (learner/run/handlers.py): every request goes through it."""

    def handle(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply: ...

    # Declared here, defined once: learner/run/handlers.py (the verifier thread's way in, rewards scored first).
    def handle_rollouts(self, identity: bytes, msg: m.Rollouts, principal: Optional[str] = None,
                        peer_address: str = "") -> Reply: ...

    def drop_actor(self, identity: bytes) -> int: ...

    def expire_leases(self) -> int: ...

    def refresh_service_discovery(self, learner_target: Optional[str]) -> None: ...


class TrainingDesk(Protocol):
    """The training thread's part of the run (learner/run/training_thread.py)."""

    def run(self, should_stop: Callable[[], bool]) -> None: ...

    def checkpoint(self) -> Path: ...


class Desk(Protocol):
    """The run as the loop sees it: the records it reads, its two threads' parts, and its end."""

    cfg: RunConfig
    metrics: LearnerMetrics
    state: LearnerState
    registry: Registry
    snapshots: SnapshotStore
    verification: Verification
    pub_address: Optional[str]

    @property
    def requests(self) -> RequestDesk: ...

    @property
    def training(self) -> TrainingDesk: ...

    def close(self) -> None: ...
