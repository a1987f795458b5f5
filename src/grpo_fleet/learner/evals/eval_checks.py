"""What makes eval Rollouts invalid: another actor's lease, a wrong shape, groups it was not leased, a lie in its
rewards. Kept apart from the round's bookkeeping (evaluation.py), so that `take` and `reward_jobs` judge the same
shapes, and the judging reads alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.evals.rounds import EvalLease, eval_sampling, submitted_ids
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason

if TYPE_CHECKING:
    from grpo_fleet.learner.actors.registry import ActorInfo
    from grpo_fleet.learner.verify.actor_checks import RewardCheck


class EvalChecks:
    """The eval round's judge of one submission (the caller holds the learner's lock)."""

    def __init__(self, cfg: RunConfig, vocab_size: int, reward_check: Optional[RewardCheck]) -> None:
        self.train, self.vocab_size, self.reward_check = cfg.train, vocab_size, reward_check
        self.max_tokens, self.reward_bound = cfg.generation.max_tokens, cfg.task.reward_bound
        self.episode_tokens = cfg.task.max_episode_tokens if cfg.task.env else None  # every sample an episode

    def shape(self, msg: m.Rollouts) -> Optional[RejectReason]:
        """Why the submission's shape is wrong for an eval lease (its samples per prompt, tokens, rewards), or None."""
        return m.validate_rollouts(msg, group_size=eval_sampling(self.train).samples, vocab_size=self.vocab_size,
                                   max_tokens=self.max_tokens, reward_bound=self.reward_bound,
                                   episode_tokens=self.episode_tokens)

    def invalid(self, lease: EvalLease, actor: ActorInfo, msg: m.Rollouts) -> Optional[RejectReason]:
        if lease.actor != actor.principal:
            return RejectReason.NOT_YOUR_LEASE
        invalid = self.shape(msg)
        if invalid is None and any(group_id not in lease.tickets for group_id in submitted_ids(msg)):
            return RejectReason.NOT_LEASED
        if invalid is None and self.reward_check is not None:
            verdicts = self.reward_check.verdicts([(g, lease.tickets[g.group_id]) for g in msg.groups])
            # A replay the episodes held past its time is charged as a lie: the reported rewards would count.
            for lie in (RejectReason.REWARD_MISMATCH, RejectReason.ENV_REPLAY_MISMATCH, RejectReason.ENV_REPLAY_TIMEOUT):
                if lie in verdicts.values():
                    return lie  # the whole lease: its prompts go back in the round
        return invalid
