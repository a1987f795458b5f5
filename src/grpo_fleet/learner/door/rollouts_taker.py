"""What intake (learner/door/intake.py) and an eval round (learner/evals/evaluation.py) both do with Rollouts.

The run's handler table (learner/run/handlers.py) routes each Rollouts to the
room that owns its lease, through this protocol only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

from grpo_fleet.protocol import messages as m

if TYPE_CHECKING:
    from grpo_fleet.learner.actors.registry import ActorInfo
    from grpo_fleet.learner.verify.actor_checks import RewardCheck


class RolloutsTaker(Protocol):
    """A room that answers Rollouts; its rewards may be re-scored ahead, outside the lock."""

    @property
    def reward_check(self) -> Optional[RewardCheck]: ...  # None: rewards are not re-scored

    def reward_jobs(self, actor: ActorInfo, msg: m.Rollouts) -> list[tuple[m.GroupResult, int]]:
        """The groups of `msg` whose rewards `take` would re-score, each with its prompt index."""
        ...

    def take(self, actor: ActorInfo, msg: m.Rollouts) -> m.Ack:
        """The answer to one Rollouts from `actor`; a replay gets the stored answer and changes nothing."""
        ...
