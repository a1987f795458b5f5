"""What keeping one accepted group does: its ledger line, its counts and speed credit, and the buffer.

Kept apart from the judging of a submission (intake.py): by the time a group gets here it is accepted, and all
that is left is to write it down and hand it to the training thread (zero-variance ones are counted, never trained).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import LedgerEntry, RunLog
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.observe.metrics import LearnerMetrics

if TYPE_CHECKING:
    from grpo_fleet.learner.actors.registry import ActorInfo, Registry


class GroupKeeper:
    """Ledger, count and buffer accepted groups (the caller holds the learner's lock)."""

    def __init__(self, state: LearnerState, registry: Registry, runlog: RunLog, metrics: LearnerMetrics,
                 handoff: BatchHandOff) -> None:
        self.state, self.registry, self.runlog, self.metrics, self.handoff = state, registry, runlog, metrics, handoff

    def keep(self, actor: ActorInfo, record: AcceptedGroup) -> None:
        """Ledger, count and buffer one accepted group (zero-variance ones are counted, never trained)."""
        state, mt = self.state, self.metrics
        informative = record.is_informative
        self.runlog.ledger(LedgerEntry(group_id=record.group_id, prompt_index=record.prompt_index,
                                       actor_id=record.actor_id, actor_key=record.actor_key,
                                       policy_version=record.policy_version, step=state.step,
                                       zero_variance=not informative))
        mt.groups_accepted.inc()
        mt.tokens_accepted.inc(record.num_tokens)
        mt.accepted_group_tokens.observe(record.num_tokens / max(1, len(record.completions)))
        observe_episodes(record, mt)
        self.registry.credit(actor, record.num_tokens, record.policy_version)
        mt.staleness.observe(state.version - record.policy_version)
        mt.group_reward.observe(float(record.rewards.mean()))
        state.accepted_since_step += 1
        if informative:
            self.handoff.put(record)
        else:
            state.zero_variance_since_step += 1
            mt.groups_zero_variance.inc()


def observe_episodes(record: AcceptedGroup, mt: LearnerMetrics) -> None:
    """An accepted group's episodes (task.env): tokens of each kind, turns, and why each ended."""
    for completion in record.completions:
        if completion.mask is None:
            continue
        sampled = int(completion.sampled.sum())
        mt.episode_tokens.labels(kind="sampled").inc(sampled)
        mt.episode_tokens.labels(kind="environment").inc(len(completion.tokens) - sampled)
        mt.episode_turns.observe(len(completion.turns or []))
        mt.episodes_ended.labels(end=completion.end).inc()
