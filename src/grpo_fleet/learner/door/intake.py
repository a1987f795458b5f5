"""Rollouts in: validate, classify, judge staleness, take accepted groups, replay answers (rules: intake_rules.py).

Plain data and NumPy, no model. The door (`messages.validate_rollouts`) refuses
values that cannot be trained on; `suspect_groups` is the second line of defence,
used when a step's loss or gradient still came out non-finite, to find whom to
blame. Every refusal has one `RejectReason`: it is the Ack's reason and the label
of the rejection metric.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np

from grpo_fleet.learner.door.group_keeper import GroupKeeper
from grpo_fleet.learner.door.intake_rules import (
    IntakeRules,
    accepted_group,
    mean_completion_tokens,
    suspect_groups,
    unusable_version,
)
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.lease_book import UNSCORED_RETURNS
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.verify.verification import Judgement, Verification
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks.scoring import RewardError

if TYPE_CHECKING:
    from grpo_fleet.learner.actors.leasing import Leasing
    from grpo_fleet.learner.actors.registry import ActorInfo, Registry
    from grpo_fleet.learner.step.step_result import StepStats
    from grpo_fleet.learner.verify.actor_checks import LogprobGap, RewardCheck

log = logging.getLogger("grpo_fleet.learner")
# Refusals of the learner's reward check: the prompt goes back in the queue for someone else to do again.
REWARD_CHECK_REFUSALS = frozenset({RejectReason.REWARD_MISMATCH, RejectReason.ENV_REPLAY_MISMATCH,
                                   RejectReason.REWARD_UNVERIFIABLE, RejectReason.REWARD_TIMEOUT,
                                   RejectReason.ENV_REPLAY_TIMEOUT})
# Those where the check did not finish (a reward or a replay failed or ran out of time): counted toward the prompt's
# skip, as a return unscored is.
CHECK_UNFINISHED = frozenset({RejectReason.REWARD_UNVERIFIABLE, RejectReason.REWARD_TIMEOUT,
                              RejectReason.ENV_REPLAY_TIMEOUT})
REWARD_ERRORS = frozenset(str(error) for error in RewardError)


class Intake:
    """Answers Rollouts: each group is accepted once, refused with a reason, or re-queued as stale."""

    def __init__(self, rules: IntakeRules, state: LearnerState, registry: Registry, leasing: Leasing,
                 runlog: RunLog, metrics: LearnerMetrics, prompt_tokens: list[np.ndarray],
                 handoff: BatchHandOff, verification: Optional[Verification] = None) -> None:
        self.rules, self.state, self.registry, self.leasing = rules, state, registry, leasing
        self.runlog, self.metrics, self.prompt_tokens = runlog, metrics, prompt_tokens
        # What judges actors (learner/verify/), asked once per Rollouts (`judge`): the re-scoring, the bounds, the
        # trust's flags. None: every check off, every group flagged.
        self.verification = verification or Verification()
        # The versions the logprob check can still recompute (a live view; None: any): work of another is refused.
        self.kept: Optional[Collection[int]] = self.verification.kept_versions()
        self.handoff = handoff
        self.keeper = GroupKeeper(state, registry, runlog, metrics, handoff)

    @property
    def reward_check(self) -> Optional[RewardCheck]:
        """What re-scores the groups `take` would accept (None: rewards are not re-scored): `reward_jobs` ahead."""
        return self.verification.reward_check

    def take(self, actor: ActorInfo, msg: m.Rollouts) -> m.Ack:
        """The answer to one Rollouts from `actor`; a replay gets the stored answer and changes nothing."""
        stored = self.state.acks.get(msg.lease_id)
        if stored is not None:
            return stored
        if self.state.done:
            # The final checkpoint is written: accepting more would put groups in
            # the ledger that no checkpoint or step ever accounts for.
            return m.Ack(lease_id=msg.lease_id, status="stale", reason=RejectReason.RUN_DONE,
                         groups={g.group_id: "stale" for g in msg.groups})
        rules, scheduler = self.rules, self.state.scheduler
        invalid = rules.invalid(msg)
        if invalid is not None:
            return self._invalid(actor, msg.lease_id, invalid)
        # An open lease, or one that expired lately (its unfinished groups still count: lease_book.py).
        known_lease = msg.lease_id in scheduler.ledger.leases or scheduler.ledger.is_late(msg.lease_id)
        refused = {g.group_id: scheduler.classify(actor.principal, msg.lease_id, g.group_id) for g in msg.groups}
        unscored = {u.group_id: scheduler.classify(actor.principal, msg.lease_id, u.group_id) for u in msg.unscored}
        violations = sorted({r for r in (*refused.values(), *unscored.values()) if r is not None and r.is_violation})
        if violations:
            return self._invalid(actor, msg.lease_id, violations[0])
        issued_at = self.leasing.issued_at(msg.lease_id)  # read now: a lease whose groups are all taken is gone
        requeued = self._unscored(actor, msg, unscored)
        unusable = unusable_version(msg, self.state, rules.max_staleness, self.kept)
        if not msg.groups:
            ack = m.Ack(lease_id=msg.lease_id, status="requeued", groups=requeued)
        elif unusable is not None:
            ack = self._stale(msg, refused, unusable, requeued)
        else:
            ack = self._accept(actor, msg, refused, requeued)
        # Only accepted groups show speed: work sent back unscored or stale must not earn a bigger share.
        self.leasing.measure(actor, issued_at, sum(status == "accepted" for status in ack.groups.values()),
                             len(msg.groups) + len(msg.unscored))
        # Only answers about leases that were open are worth replaying.
        if known_lease:
            self.state.acks.put(msg.lease_id, ack)
        self.metrics.leases_outstanding.set(len(scheduler.ledger.leases))
        return ack

    def reward_jobs(self, actor: ActorInfo, msg: m.Rollouts) -> list[tuple[m.GroupResult, int]]:
        """The groups `take` would re-score, with their prompts; reads the state, changes nothing (under the lock)."""
        rules, scheduler = self.rules, self.state.scheduler
        if (self.reward_check is None or self.state.done or self.state.acks.get(msg.lease_id) is not None
                or unusable_version(msg, self.state, rules.max_staleness, self.kept) is not None
                or rules.invalid(msg) is not None):
            return []
        return [(g, scheduler.leased_prompt(msg.lease_id, g.group_id)) for g in msg.groups
                if scheduler.classify(actor.principal, msg.lease_id, g.group_id) is None]

    def _invalid(self, actor: ActorInfo, lease_id: str, reason: RejectReason) -> m.Ack:
        """Refuse hostile or malformed rollouts; this counts toward the peer's ban and changes no state."""
        self.metrics.rejections.labels(reason=reason).inc()
        self.registry.record_violation(actor.principal, reason)
        return m.Ack(lease_id=lease_id, status="invalid", reason=reason)

    def _unscored(self, actor: ActorInfo, msg: m.Rollouts,
                  classified: dict[str, Optional[RejectReason]]) -> dict[str, str]:
        """Re-queue the groups the actor could not score (tasks/scoring.py) for another key; a prompt failing
        repeatedly, for several keys, is dropped (records/lease_book.py)."""
        answer: dict[str, str] = {}
        scheduler, live_keys = self.state.scheduler, self.registry.key_count()
        for group in msg.unscored:
            refusal = classified[group.group_id]
            if refusal is not None:  # a duplicate, or a lease that expired meanwhile: nothing to re-queue
                answer[group.group_id] = refusal.group_status
                continue
            reward = group.reward if group.reward in self.rules.reward_names else "*"
            error = group.error if group.error in REWARD_ERRORS else "other"  # labels stay a bounded set
            self.metrics.groups_unscored.labels(reward=reward, error=error).inc()
            if scheduler.return_unscored(msg.lease_id, group.group_id, actor.principal, live_keys):
                self.metrics.groups_unscorable.inc()
                log.warning("prompt of group %s came back unscored %d times (last: reward %s %s: %s); skipped for "
                            "this pass", group.group_id, UNSCORED_RETURNS, shown(reward), error,
                            shown(group.detail, 200))
                answer[group.group_id] = "unscorable"
            else:
                self.metrics.unscored_requeues.labels(to="another_key" if live_keys > 1 else "any_key").inc()
                answer[group.group_id] = "requeued"
        return answer

    def _stale(self, msg: m.Rollouts, refused: dict[str, Optional[RejectReason]], reason: RejectReason,
               requeued: dict[str, str]) -> m.Ack:
        for group_id, refusal in refused.items():
            if refusal is None:
                self.state.scheduler.requeue(msg.lease_id, group_id)
        self.metrics.rejections.labels(reason=reason).inc(len(msg.groups))
        for group in msg.groups:  # do long completions come back too late more often? (docs/learner-step.md: Staleness)
            self.metrics.stale_group_tokens.observe(mean_completion_tokens(group))
        return m.Ack(lease_id=msg.lease_id, status="stale", reason=reason,
                     groups={**{g: "stale" for g in refused}, **requeued})

    def _accept(self, actor: ActorInfo, msg: m.Rollouts, refused: dict[str, Optional[RejectReason]],
                requeued: dict[str, str]) -> m.Ack:
        answer: dict[str, str] = {}
        judged = self._judge(actor, msg, refused)
        refused = {**refused, **judged.refusals()}
        late = self.state.scheduler.ledger.is_late(msg.lease_id)
        records = []
        for group in msg.groups:
            refusal = refused[group.group_id]
            if refusal is not None:  # a duplicate, a lease that expired meanwhile, or rewards that do not add up
                answer[group.group_id] = self._refuse_group(actor, msg.lease_id, group.group_id, refusal)
                continue
            ticket = self.state.scheduler.finish(msg.lease_id, group.group_id)
            index = ticket.prompt_index
            records.append(accepted_group(group, index, self.prompt_tokens[index], msg.policy_version, actor))
        for record in records:
            if record.is_informative:  # only those train: each gets its bound, and whether the logprob check sees it
                record.logprob_bound, record.token_bound = judged.bound.mean, judged.bound.token
                record.check_logprobs = record.group_id in judged.flagged
        if late and records:
            self.metrics.late_groups.labels(kind="train").inc(len(records))
        for record in records:
            self.keeper.keep(actor, record)
            answer[record.group_id] = "accepted"
        overall = "accepted" if "accepted" in answer.values() else next(iter(answer.values()))
        return m.Ack(lease_id=msg.lease_id, status=overall, groups={**answer, **requeued})  # type: ignore[arg-type]  # one of Ack's statuses

    def _judge(self, actor: ActorInfo, msg: m.Rollouts, refused: dict[str, Optional[RejectReason]]) -> Judgement:
        """verify/'s one answer on the groups nothing refused yet: their rewards re-scored (security.verify_rewards),
        the actor's honest bound, and which of them the logprob check recomputes."""
        # A submission for a lease nobody remembers (released, forgotten, or from before a resume) has every group
        # refused as stale_lease and already re-queued: there is nothing to verify, and no lease to read. A group
        # nothing refused is under this lease, open or late (classify said so): its ticket names the prompt.
        scheduler = self.state.scheduler
        pending = [(g, scheduler.leased_prompt(msg.lease_id, g.group_id)) for g in msg.groups if refused[g.group_id] is None]
        return self.verification.judge(actor.principal, actor.backend, pending)

    def _refuse_group(self, actor: ActorInfo, lease_id: str, group_id: str, reason: RejectReason) -> str:
        """Count one refused group; a reward check's refusal re-queues the prompt (and charges a mismatch)."""
        self.metrics.rejections.labels(reason=reason).inc()
        if reason in CHECK_UNFINISHED:
            self._check_unfinished(actor, lease_id, group_id, reason)
        elif reason in REWARD_CHECK_REFUSALS:
            # Its fault (a mismatch): another actor does it again, not this one for ever.
            self.state.scheduler.requeue(lease_id, group_id, not_to=actor.principal)
        if reason in (RejectReason.REWARD_MISMATCH, RejectReason.ENV_REPLAY_MISMATCH):
            self.registry.record_violation(actor.principal, reason)
            log.warning("actor %s reported rewards the learner does not get for group %s", shown(actor.actor_id),
                        group_id)
        elif reason in (RejectReason.REWARD_TIMEOUT, RejectReason.ENV_REPLAY_TIMEOUT):
            # Its completions held the one verifier thread for a reward timeout or the replay's
            # security.replay_seconds: after max_violations, banned.
            self.registry.record_violation(actor.principal, reason)
            log.warning("actor %s sent work the learner's check ran out of time on (group %s: %s)",
                        shown(actor.actor_id), group_id, reason)
        return reason.group_status

    def _check_unfinished(self, actor: ActorInfo, lease_id: str, group_id: str, reason: RejectReason) -> None:
        """A group the learner's check could not finish goes back as an unscored one does: to another key, and
        its prompt is skipped for the pass after a few such returns (records/lease_book.py), so a prompt whose
        check always fails or hangs is not regenerated for ever."""
        scheduler = self.state.scheduler
        if scheduler.return_unscored(lease_id, group_id, actor.principal, self.registry.key_count()):
            self.metrics.groups_unscorable.inc()
            log.warning("the prompt of group %s could not be checked %d times in a row (last: %s); skipped for this "
                        "pass", group_id, UNSCORED_RETURNS, reason)

    def blame_tampered(self, failures: list[tuple[AcceptedGroup, LogprobGap]],
                       in_hand: Sequence[AcceptedGroup] = ()) -> None:
        """Logprobs that the claimed version cannot have produced: ban the actor now, drop all it sent.

        `in_hand`: groups already out of the buffer (the batch being checked); the
        liar's among them are dropped too, so nothing of it trains.
        """
        blamed: set[str] = set()
        for group, gap in failures:
            key = group.actor_key
            if key in blamed:  # several of its checked groups failed: one ban, one drop
                continue
            blamed.add(key)
            dropped = [g for g in (*in_hand, *self.state.buffer) if g.actor_key == key]
            # Their prompts go to honest actors, as new groups.
            self.handoff.drop(dropped, RejectReason.LOGPROB_MISMATCH)
            self.metrics.rejections.labels(reason=RejectReason.LOGPROB_MISMATCH).inc(len(dropped))
            released = self.state.scheduler.release_actor(key)
            self.registry.record_violation(key, RejectReason.LOGPROB_MISMATCH, ban_now=True)
            log.warning("actor %s: group %s (claimed v%d) has logprobs %.4f nats off the learner's on average, %.3f "
                        "at worst (honest bounds %.4f and %.3f: the %s broke it); banned after step %d, %d of its "
                        "groups dropped, %d leases re-queued", shown(group.actor_id), group.group_id,
                        group.policy_version, gap.mean, gap.max, gap.bound, gap.token_bound, gap.broke,
                        self.state.step, len(dropped), released)

    def blame_poisoned(self, groups: list[AcceptedGroup], stats: StepStats, step: int) -> None:
        """A non-finite loss or gradient applied no update; count it and charge the groups that caused it.

        The step still counts (its groups are consumed) but the weights did not
        move. Groups holding values outside their float32 bounds count toward
        their actors' bans; if none does, the inputs were clean and nobody is
        blamed: the fault is the learner's numerics, and the log says so.
        """
        self.metrics.skipped_updates.labels(reason=stats.skipped).inc()
        suspects = suspect_groups(groups, self.rules.reward_bound)
        culprits = sorted({shown(g.actor_id) for g in groups if g.group_id in suspects})
        log.warning("step %d applied no update: %s (loss %s, grad norm %s); %s", step, stats.skipped,
                    stats.loss, stats.grad_norm,
                    f"out-of-bounds values in {len(suspects)} groups from actors {', '.join(culprits)}"
                    if culprits else "every input was within bounds, so no actor is blamed")
        for group in groups:
            if group.group_id in suspects and group.actor_key:
                self.registry.record_violation(group.actor_key, f"poisoned_{suspects[group.group_id]}")
