"""What the batch's logprob check (batch_checks.py) reads of the run, named as Protocols on this floor.

The run's rooms (learner/run/rooms.py: RunRooms), the actors' bans and intake sit above verify/; naming what is
read of them here lets the check take the run without importing anything from above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.actor_checks import LogprobGap
from grpo_fleet.learner.verify.verification import Verification
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import LearnerMetrics


class BanCount(Protocol):
    def times_banned(self, key: str) -> int: ...


class Banning(Protocol):
    """The actors' bans (learner/actors/registry.py, a floor above): how often a key was banned before."""

    @property
    def bans(self) -> BanCount: ...


class Blaming(Protocol):
    """Intake (learner/door/intake.py, a floor above): bans a liar and drops all it sent."""

    def blame_tampered(self, failures: list[tuple[AcceptedGroup, LogprobGap]],
                       in_hand: Sequence[AcceptedGroup] = ()) -> None: ...


class CheckedRun(Protocol):
    """What the check plan reads of the run (learner/run/rooms.py: RunRooms), named here, below the door and the
    fleet, so that this floor imports nothing from above it."""

    @property
    def cfg(self) -> RunConfig: ...
    @property
    def state(self) -> LearnerState: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def verification(self) -> Verification: ...
    @property
    def registry(self) -> Banning: ...
    @property
    def intake(self) -> Blaming: ...
    @property
    def trainer(self) -> Trainer: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def handoff(self) -> BatchHandOff: ...
    @property
    def metrics(self) -> LearnerMetrics: ...
    @property
    def runlog(self) -> RunLog: ...
