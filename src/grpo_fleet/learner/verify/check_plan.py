"""The records of one batch's logprob check (batch_checks.py): how each group is checked, what trained, and the
training thread's side of it, named here so that this floor imports nothing from the run above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Optional, Protocol, TypeVar

import numpy as np

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.step.fused_check import Recheck, check_bounds_array
from grpo_fleet.learner.step.gap_bounds import GapBound
from grpo_fleet.learner.step.step_result import StepStats


@dataclass
class CheckPlan:
    """How each group of one batch is checked; `fused` follows the batch's group order."""

    fused: list[Optional[GapBound]]
    screens: dict[int, float] = field(default_factory=dict)  # group index -> token bound of the step's screen
    forward: list[AcceptedGroup] = field(default_factory=list)
    unchecked: list[tuple[AcceptedGroup, str]] = field(default_factory=list)
    recheck: Optional[Recheck] = None  # `forward`, recomputed inside a data-parallel step (TrainBatch.recheck)
    seconds: float = 0.0  # spent on this batch's checks, the forwards and the step's comparison (its slowest rank's)

    def fused_bounds(self) -> Optional[np.ndarray]:
        """`TrainBatch.check`: None when the step checks nothing itself."""
        if not self.screens and all(b is None for b in self.fused):
            return None
        return check_bounds_array(self.fused, self.screens)

    @property
    def checked(self) -> int:
        return sum(b is not None for b in self.fused) + len(self.forward)


class TrainedStep(Protocol):
    """What the check reads of a trained step (learner/run/batch_cycle.py: TrainedBatch)."""

    @property
    def stats(self) -> StepStats: ...
    @property
    def published(self) -> Optional[int]: ...  # the version the step published, if it did


Trained = TypeVar("Trained", bound=TrainedStep, covariant=True)


class BatchSteps(Protocol[Trained]):
    """The training thread's part of a checked batch (learner/run/batch_cycle.py: BatchCycle), which the check
    calls in its order: what is taken under the run's lock, and the step, without it."""

    def drop_too_stale(self, state: LearnerState) -> int: ...
    def ready(self, state: LearnerState) -> bool: ...
    def take_batch(self, state: LearnerState) -> tuple[list[AcceptedGroup], int]: ...
    def run(self, groups: list[AcceptedGroup], trained_on: int, step: int, check: Optional[np.ndarray] = None,
            recheck: Optional[Recheck] = None) -> Trained: ...


Done = TypeVar("Done", bound=TrainedStep)


@dataclass(frozen=True)
class CheckedBatch(Generic[Done]):
    """A batch the logprob check let train (`BatchChecks.train`): its groups, the step, and what the check cost."""

    groups: list[AcceptedGroup]
    step: int
    trained: Done  # the training thread's own record of the step
    seconds: float  # spent on the batch's checks: the forwards and the step's comparison (its slowest rank's)
    checked: int  # groups checked, in the step or by a forward
    unchecked: int  # groups trained unchecked (each counted and ledgered with its reason)
