"""The learner's run state: one explicit record that its rooms share under `Learner.lock`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from grpo_fleet.learner.records.acks import AckCache
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.lease_book import PromptScheduler


@dataclass
class LearnerState:
    """Everything the learner is the source of truth for, besides weights and optimizer state.

    A checkpoint saves all of it but `incarnation` and `history_version`
    (persistence.capture / save); a resume restores it (persistence.load / restore).
    Only the training thread moves `step` and `version`, always under the lock.
    """

    run_id: str
    # This life of the learner process (m.Incarnation): new on every start and resume.
    incarnation: str
    steps_target: int
    scheduler: PromptScheduler  # prompt order, open leases, finished groups
    acks: AckCache = field(default_factory=lambda: AckCache())  # answers replayed to resent Rollouts
    step: int = 0
    version: int = 0
    # Versions up to here were published, with these same weights, by earlier lives too.
    history_version: int = 0
    # Whether the live weights are version `version`'s: not after a step that did not publish (train.sync_every > 1).
    weights_published: bool = True
    buffer: list[AcceptedGroup] = field(default_factory=list)  # informative, accepted, untrained; oldest first
    accepted_since_step: int = 0
    zero_variance_since_step: int = 0
    # prompt index -> groups of it in a row that came back unscored (not checkpointed: a resume forgives).
    unscored_attempts: dict[int, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # moved back by the wall time of earlier lives

    @property
    def done(self) -> bool:
        return self.step >= self.steps_target

    def wall_seconds(self) -> float:
        """Training wall time of the whole run, earlier lives included."""
        return time.monotonic() - self.started
