"""How a group's completions become rewards, and what happens when a reward misbehaves.

The policy, in one place (docs/tasks.md, "Your own rewards", says the same):

- A completion's reward is the weighted sum of the rewards that scored it. A
  reward that returns None has no opinion on that completion and adds nothing
  (TRL's rule); a completion no reward scores has no reward at all.
- A reward that raises, returns something other than a number (bools and ints
  are numbers), returns NaN or infinity, returns more than `bound` in absolute
  value (the float32 range the learner trains in), or runs past its timeout,
  fails the whole group, as does a completion no reward scores. A group's
  advantages need all G rewards, so the learner never trains on a partial
  score: the group is sent back unscored, counted under the reward's name and
  the error, and the learner re-queues its prompt (see learner/door/intake.py).

Pure functions over already-made calls: `reward_runner.py` makes the calls,
in a child process with timeouts on actors, inline elsewhere.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union


class RewardError(str, enum.Enum):
    """Why a reward could not score a completion (the `error` label of the reward-error metrics)."""

    EXCEPTION = "exception"
    TIMEOUT = "timeout"
    NON_FINITE = "non_finite"
    NOT_A_NUMBER = "not_a_number"
    OUT_OF_BOUNDS = "out_of_bounds"
    NO_SCORE = "no_score"  # every reward returned None for some completion
    CRASHED = "crashed"  # the scoring process died (killed at the hard deadline, or by the reward)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RewardFailure:
    """The first failure that made a group unscorable."""

    reward: str  # the reward's name, or "*" when no single reward is to blame (NO_SCORE, CRASHED)
    error: RewardError
    detail: str = ""


@dataclass(frozen=True)
class ScoringJob:
    """One prompt's group to score: what each reward is called with."""

    prompt: str
    columns: Mapping[str, Any]  # keyword arguments: the dataset's columns and `answer`
    completions: Sequence[str]


@dataclass(frozen=True)
class GroupScore:
    """A group's rewards, one per completion, or why it has none."""

    rewards: Optional[list[float]] = None
    failure: Optional[RewardFailure] = None
    # Seconds spent per reward over the group, for the reward-duration metric.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rewards is not None


def checked_value(name: str, value: Any, bound: float) -> Union[Optional[float], RewardFailure]:
    """The float a reward returned (None stays None), or the failure it is."""
    if value is None:
        return None
    if not isinstance(value, (int, float)):
        return RewardFailure(name, RewardError.NOT_A_NUMBER, f"returned {type(value).__name__}, not a float or None")
    number = float(value)
    if not math.isfinite(number):
        return RewardFailure(name, RewardError.NON_FINITE, f"returned {number}")
    if abs(number) > bound:
        return RewardFailure(name, RewardError.OUT_OF_BOUNDS, f"returned {number:g}, beyond +-{bound:g} (task.reward_bound)")
    return number


def combine(values: Sequence[Optional[float]], weights: Sequence[float]) -> Optional[float]:
    """Weighted sum over the rewards that scored (not None); None when none did."""
    scored = [(value, weight) for value, weight in zip(values, weights) if value is not None]
    if not scored:
        return None
    return float(sum(weight * value for value, weight in scored))


def group_score(per_completion: Sequence[Sequence[Union[Optional[float], RewardFailure]]], weights: Sequence[float],
                bound: float, seconds: Optional[dict[str, float]] = None) -> GroupScore:
    """A group's score from each completion's per-reward outcomes (in reward order); the first failure wins.

    The weighted sum is bounded too: the learner refuses a reward beyond `bound`
    as hostile, and an honest actor must not be banned for its weights.
    """
    rewards: list[float] = []
    for outcomes in per_completion:
        failure = next((o for o in outcomes if isinstance(o, RewardFailure)), None)
        if failure is not None:
            return GroupScore(failure=failure, seconds=seconds or {})
        total = combine([o for o in outcomes if not isinstance(o, RewardFailure)], weights)
        if total is None:
            return GroupScore(failure=RewardFailure("*", RewardError.NO_SCORE, "every reward returned None"),
                              seconds=seconds or {})
        if abs(total) > bound:
            return GroupScore(failure=RewardFailure("*", RewardError.OUT_OF_BOUNDS,
                                                    f"weighted sum {total:g} beyond +-{bound:g} (task.reward_bound)"),
                              seconds=seconds or {})
        rewards.append(total)
    return GroupScore(rewards=rewards, seconds=seconds or {})
