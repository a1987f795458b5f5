"""Scoring a lease: decode each completion, run the rewards (tasks/reward_runner.py), split scored from unscored;
and the process the rewards run in (`RunRewards`).

A group a reward failed on is sent back unscored, with the reward and the
error, never with a partial score (tasks/scoring.py is the policy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from grpo_fleet.actor import wire
from grpo_fleet.actor.admission import ActorRefused
from grpo_fleet.models.generation import GeneratedCompletion, completion_text
from grpo_fleet.observe.metrics import ActorMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.tasks.reward_runner import RewardSet, RewardsRefused, Scorer, ScoringProcess
from grpo_fleet.tasks.scoring import GroupScore, ScoringJob

log = logging.getLogger("grpo_fleet.actor")


def scoring_jobs(items: Sequence[m.PromptItem], groups: Sequence[Sequence[GeneratedCompletion]],
                 tokenizer: Any) -> list[ScoringJob]:
    """What each reward is called with, for every group of a lease."""
    eos = set(tokenizer.eos_token_ids)
    return [
        ScoringJob(prompt=item.prompt_text, columns=dict(item.fields),
                   completions=[completion_text(tokenizer, c, eos) for c in completions])
        for item, completions in zip(items, groups)
    ]


def score_lease(items: Sequence[m.PromptItem], groups: Sequence[Sequence[GeneratedCompletion]], scorer: Scorer,
                tokenizer: Any, metrics: ActorMetrics) -> tuple[list[m.GroupResult], list[m.UnscoredGroup]]:
    """The lease's scored groups and the ones a reward failed on."""
    scores = scorer.score(scoring_jobs(items, groups, tokenizer))
    scored, unscored = [], []
    for item, completions, score in zip(items, groups, scores):
        _observe(score, completions, metrics)
        if score.rewards is not None:
            scored.append(wire.to_group(item.group_id, completions, score.rewards))
            continue
        failure = score.failure
        assert failure is not None  # a GroupScore has rewards or a failure
        log.warning("group %s unscored: reward %s %s: %s", item.group_id, shown(failure.reward), failure.error,
                    shown(failure.detail, 300))
        unscored.append(m.UnscoredGroup(group_id=item.group_id, reward=shown(failure.reward, 64)[:64],
                                        error=str(failure.error), detail=shown(failure.detail, 1000)[:4096]))
    return scored, unscored


class RunRewards:
    """The learner's rewards in a process of their own: started on admission, restarted when the run's rewards change."""

    def __init__(self) -> None:
        self.rewards: Optional[RewardSet] = None
        self.scorer: Optional[Scorer] = None

    def start(self, rewards: RewardSet) -> None:
        """(Re)start the rewards' process when the run's rewards change; a load failure refuses the run."""
        if rewards == self.rewards and self.scorer is not None:
            return
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        try:
            self.scorer = ScoringProcess(rewards)
        except RewardsRefused as exc:
            raise ActorRefused(f"this actor cannot run the learner's rewards: {exc}") from exc
        self.rewards = rewards

    def score(self, items: Sequence[m.PromptItem], groups: Sequence[Sequence[GeneratedCompletion]], tokenizer: Any,
              metrics: ActorMetrics) -> tuple[list[m.GroupResult], list[m.UnscoredGroup]]:
        """`score_lease` in the rewards' process."""
        assert self.scorer is not None  # the actor's admission started it
        return score_lease(items, groups, self.scorer, tokenizer, metrics)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()


def _observe(score: GroupScore, completions: Sequence[GeneratedCompletion], metrics: ActorMetrics) -> None:
    for name, seconds in score.seconds.items():
        metrics.reward_seconds.labels(reward=name).observe(seconds)
    metrics.tokens_generated.inc(sum(len(c.tokens) for c in completions))
    metrics.groups_generated.inc()
    if score.rewards is not None:
        for reward in score.rewards:
            metrics.reward.observe(reward)
    elif score.failure is not None:
        metrics.reward_errors.labels(reward=score.failure.reward, error=str(score.failure.error)).inc()
