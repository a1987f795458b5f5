"""The logprob check of one batch, on the training thread: which groups are checked, how, and what trains unchecked.

Every group of a batch goes one of three ways (`plan`):

- **fused**: sampled at the version the step trains from, while the live weights
  are that version's: checked inside the step against its own first forward
  (learner/step/fused_check.py), for the price of a comparison. Always. A
  loss that gives no policy logprobs (objective.py: Loss) costs the step one no-grad
  forward for it (FrozenForwards.proximal), so a custom loss never turns it off.
- **forward**: an older version, flagged at intake (probation, or drawn:
  learner/verify/trust.py), or sent by a key that was banned before (it earns no
  probation credit back: learner/actors/bans.py): recomputed at its version before anything is
  applied. With one rank, here before the step; with several ranks under LoRA,
  inside the step by the ranks that train its rows, each recomputing its own
  (the version's adapters travel with the batch: learner/step/recheck.py), so
  the forwards are spread over the ranks. Under full fine-tuning a version's
  weights are too heavy to send each step: those checks stay on rank 0.
- **unchecked**, with a reason counted in `grpo_fleet_learner_groups_unchecked_total`
  and written to the ledger: `sampled_out` (not drawn), `verification_off`,
  `version_gone` (its weights are not kept; this stays 0: see below).

A buffered group whose version's weights are not kept could be neither
recomputed nor screened. Intake refuses such work (`version_gone`), and those a
full fine-tuning resume restores from the checkpoint's buffer (only LoRA saves
its versions' weights with a checkpoint) are dropped before a batch is taken
(`drop_unverifiable`): their prompts go back to be sampled again, counted in
`grpo_fleet_learner_rejections_total{reason="version_gone"}` and ledgered.

Every other group whose version is kept is also **screened** inside the step,
checked or not: its tokens against the step's own forward, a few versions on,
under `security.screen_token_nats`. That includes, with `train.sync_every` > 1,
the groups of the step's own version on the steps between two publishes, whose
weights are already a few updates past it (so not fused; flagged ones are
recomputed at their version, as older ones are). Honest drift over a few versions stays far
under it; a token whose reported logprob was moved by many nats (the lie that
buys a huge ratio) does not, in whichever completion it hides. A group beyond
the screen drops the step's gradients and is recomputed whole at its version:
a lie is dealt with as any failed check, an honest group is cleared (counted
`logprob_checks_total{how="screen",result="cleared"}`) and the batch trains
again with it unscreened.

A failed check bans the actor and drops everything of it, the batch's groups
included; the rest of the batch goes back to the head of the buffer untrained,
and the next step takes it again. Nothing is applied before the check is done,
so a lie never trains.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Optional

import numpy as np

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import UncheckedEntry
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.step.fused_check import CheckedGroup, Recheck
from grpo_fleet.learner.step.gap_bounds import GapBound
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.learner.verify.actor_checks import LogprobGap
from grpo_fleet.learner.verify.check_plan import BatchSteps, CheckedBatch, CheckPlan, Trained
from grpo_fleet.learner.verify.checked_run import CheckedRun
from grpo_fleet.protocol.reasons import RejectReason

SAMPLED_OUT, VERIFICATION_OFF, VERSION_GONE = "sampled_out", "verification_off", "version_gone"
_PICKER = random.SystemRandom()  # which completions a forward check recomputes: the OS's randomness


class BatchChecks:
    """Plans and runs the logprob check of each batch; the caller holds no lock (each method takes it as needed)."""

    def __init__(self, rooms: CheckedRun) -> None:
        self.rooms = rooms
        self.cleared: set[str] = set()  # groups recomputed whole after the screen: their retry is not screened

    def train(self, cycle: BatchSteps[Trained]) -> Optional[CheckedBatch[Trained]]:
        """One checked optimizer batch: the training thread's one call (it holds no lock; this takes it as needed).

        Under the lock: too-stale and then unverifiable groups dropped, the batch
        taken and planned. Then its older groups recomputed, the step run with
        its own check and screen, the unchecked groups counted and ledgered, and
        the published version's weights kept. None when no batch is ready, or a
        check found a lie or sent the batch back to be recomputed: nothing of it
        trained, and the rest of it is back in the buffer.
        """
        rooms, state = self.rooms, self.rooms.state
        with rooms.lock:
            # Stale groups go first, then the batch is taken and checked as it is: no group slides in unchecked.
            cycle.drop_too_stale(state)
            self.drop_unverifiable(state)
            if not cycle.ready(state):
                return None
            groups, trained_on = cycle.take_batch(state)
            plan = self.plan(groups, trained_on, state.weights_published)
            step = state.step + 1  # only the training thread moves the step
        if not self.forward(plan, groups):
            return None
        trained = cycle.run(groups, trained_on, step, plan.fused_bounds(), plan.recheck)
        if not self.fused(plan, groups, trained.stats):
            return None
        with rooms.lock:
            self.record_unchecked(plan, step)
        history = rooms.verification.history
        if trained.published is not None and history is not None:
            history.record(trained.published)  # the weights the step left are that version's, which actors sample
        return CheckedBatch(groups, step, trained, plan.seconds, plan.checked, len(plan.unchecked))

    def plan(self, groups: list[AcceptedGroup], trained_on: int, weights_published: bool) -> CheckPlan:
        """Sort a batch's groups into fused, forward and unchecked (under the lock: flags and history are shared)."""
        check, history = self.rooms.verification.logprob_check, self.rooms.verification.history
        plan = CheckPlan(fused=[None] * len(groups))
        if check is None or history is None:
            plan.unchecked = [(g, VERIFICATION_OFF) for g in groups]
            return plan
        fuse = weights_published  # the live weights are trained_on's: its groups are checked exactly in the step
        screen = self.rooms.cfg.security.screen_token_nats
        # A cleared group dropped before its retry (too stale, or its actor banned) never comes back: forget it.
        self.cleared &= {g.group_id for g in groups} | {g.group_id for g in self.rooms.state.buffer}
        for index, group in enumerate(groups):
            if fuse and group.policy_version == trained_on:
                plan.fused[index] = check.bound_of(group)
                continue
            cleared = group.group_id in self.cleared
            self.cleared.discard(group.group_id)
            if screen > 0 and not cleared and group.policy_version in history.versions:
                plan.screens[index] = screen
            if not (group.check_logprobs or self.rooms.registry.bans.times_banned(group.actor_key)):
                plan.unchecked.append((group, SAMPLED_OUT))
            elif group.policy_version not in history.versions:
                plan.unchecked.append((group, VERSION_GONE))
            else:
                plan.forward.append(group)
        if plan.forward and self._spread():
            plan.recheck = self._recheck(plan.forward, groups)
        return plan

    def drop_unverifiable(self, state: LearnerState) -> int:
        """Drop buffered groups of versions whose weights are not kept (under the lock), their prompts re-queued;
        returns how many. None trains unchecked for want of its version (a full fine-tuning resume's buffer)."""
        history = self.rooms.verification.history
        if self.rooms.verification.logprob_check is None or history is None:
            return 0
        gone = [g for g in state.buffer if g.policy_version not in history.versions]
        if gone:
            self.rooms.handoff.drop(gone, RejectReason.VERSION_GONE)
            self.rooms.metrics.rejections.labels(reason=RejectReason.VERSION_GONE).inc(len(gone))
        return len(gone)

    def _spread(self) -> bool:
        """Whether older groups are recomputed inside the step, each rank its own rows: with several ranks, under
        LoRA (its adapters are small enough to send with a batch; full weights would not be)."""
        return self.rooms.trainer.sharding.size > 1 and self.rooms.policy.lora is not None

    def _recheck(self, forward: list[AcceptedGroup], groups: list[AcceptedGroup]) -> Recheck:
        """`TrainBatch.recheck` of `forward`: each group's bound, and its picked rows (group-major) with the index of
        its version's weights."""
        check, history = self.rooms.verification.logprob_check, self.rooms.verification.history
        assert check is not None and history is not None, "the plan recomputes only when verifying"
        size, versions = len(groups[0].completions), sorted({g.policy_version for g in forward})
        bounds = np.full((len(groups), 2), np.inf, np.float32)
        rows = np.full(len(groups) * size, -1, np.int32)
        place = {id(group): index for index, group in enumerate(groups)}
        for group in forward:
            index, bound = place[id(group)], check.bound_of(group)
            bounds[index] = (bound.mean, bound.token)
            rows[index * size + np.array(self._picked(size))] = versions.index(group.policy_version)
        return Recheck(bounds, rows, tuple(tuple(history.versions[v]) for v in versions))

    def forward(self, plan: CheckPlan, groups: list[AcceptedGroup]) -> bool:
        """Recompute the plan's older groups at their versions (no lock held while it runs); False on a lie."""
        check = self.rooms.verification.logprob_check
        if check is None or not plan.forward or plan.recheck is not None:  # none, or the step recomputes them
            return True
        started = time.perf_counter()
        parts = [self._part(group) for group in plan.forward]
        picked = {id(part): group for part, group in zip(parts, plan.forward)}
        failures = [(picked[id(part)], gap) for part, gap in check.failures(parts)]
        plan.seconds += time.perf_counter() - started
        self._count("forward", len(plan.forward), len(failures))
        with self.rooms.lock:
            _forward_done(plan)
            return self._settle(plan.forward, failures, groups)

    def fused(self, plan: CheckPlan, groups: list[AcceptedGroup], stats: StepStats) -> bool:
        """Apply the step's own check and screen (`stats.checked`); False when nothing was applied: a lie was
        found, or an older group broke the screen (then recomputed whole at its version here)."""
        plan.seconds += stats.check_seconds
        own = [c for c in stats.checked if c.index not in plan.screens]
        screened = [c for c in stats.checked if c.index in plan.screens]
        checked = [groups[c.index] for c in own]
        failures = [(groups[c.index], _gap(groups[c.index], c, plan.fused[c.index]))
                    for c in own if c.broke is not None]
        suspects = [groups[c.index] for c in screened if c.broke is not None]
        self._count("fused", len(checked), len(failures))
        self._count("screen", len(screened), len(suspects))
        rechecked, lies = self._rechecked(plan, groups, stats)
        failures += lies
        observe = self.rooms.metrics.logprob_gap.observe
        for c in (*own, *stats.rechecked):
            observe(c.mean)
        if suspects and not failures:
            with self.rooms.lock:
                self._settle(rechecked, [], groups)  # credited, as a forward check before the step is
            return self._recompute_suspects(plan, suspects, groups)
        with self.rooms.lock:
            return self._settle(checked + rechecked, failures, groups)

    def _rechecked(self, plan: CheckPlan, groups: list[AcceptedGroup],
                   stats: StepStats) -> tuple[list[AcceptedGroup], list[tuple[AcceptedGroup, LogprobGap]]]:
        """The groups the step recomputed at their versions (`plan.recheck`), and those that broke their bounds."""
        if plan.recheck is None:
            return [], []
        bounds = plan.recheck.bounds
        failures = [(groups[c.index], _gap(groups[c.index], c, GapBound(*map(float, bounds[c.index]))))
                    for c in stats.rechecked if c.broke is not None]
        self._count("forward", len(stats.rechecked), len(failures))
        with self.rooms.lock:
            _forward_done(plan)
        return plan.forward, failures

    def _recompute_suspects(self, plan: CheckPlan, suspects: list[AcceptedGroup], groups: list[AcceptedGroup]) -> bool:
        """Older groups beyond the step's screen, recomputed whole at their versions: the liars are dealt with as
        any failed check, the honest cleared for the batch's retry; the batch goes back untrained either way."""
        check = self.rooms.verification.logprob_check
        assert check is not None, "the plan screens only when verifying"
        started = time.perf_counter()
        failures = check.failures(suspects)
        plan.seconds += time.perf_counter() - started
        self._count("forward", len(suspects), len(failures))
        liars = {group.actor_key for group, _ in failures}
        cleared = [g for g in suspects if g.actor_key not in liars]
        self.rooms.metrics.logprob_checks.labels(how="screen", result="cleared").inc(len(cleared))
        self.cleared.update(g.group_id for g in cleared)
        with self.rooms.lock:
            if self._settle(suspects, failures, groups):
                self.rooms.handoff.put_back(groups)
        return False

    def record_unchecked(self, plan: CheckPlan, step: int) -> None:
        """Count and ledger each group that trained unchecked (under the lock, like every ledger line)."""
        metrics, runlog = self.rooms.metrics, self.rooms.runlog
        for group, reason in plan.unchecked:
            metrics.groups_unchecked.labels(reason=reason).inc()
            runlog.unchecked(UncheckedEntry(group_id=group.group_id, actor_id=group.actor_id,
                                            actor_key=group.actor_key, reason=reason, step=step))
        metrics.step_check_seconds.observe(plan.seconds)

    def _settle(self, checked: list[AcceptedGroup], failures: list[tuple[AcceptedGroup, LogprobGap]],
                groups: list[AcceptedGroup]) -> bool:
        """Credit the honest, ban the liars (their groups, the batch's included, dropped) and return the batch
        to the buffer's head untrained; True when nothing failed."""
        liars = {group.actor_key for group, _ in failures}
        for group in checked:
            if group.actor_key not in liars:
                self.rooms.verification.trust.record_pass(group.actor_key)
        if not failures:
            return True
        self.rooms.intake.blame_tampered(failures, in_hand=groups)
        self.rooms.handoff.put_back([g for g in groups if g.actor_key not in liars])
        return False

    def _part(self, group: AcceptedGroup) -> AcceptedGroup:
        """The completions of `group` a forward check recomputes (`_picked`)."""
        picked = self._picked(len(group.completions))
        return group if len(picked) == len(group.completions) else replace(
            group, completions=[group.completions[i] for i in picked])

    def _picked(self, size: int) -> list[int]:
        """Which of a group's `size` completions a forward check recomputes: security.check_completions of them,
        unpredictably (a forward's cost is per completion; a liar cannot know which it must get right)."""
        count = self.rooms.cfg.security.check_completions
        return list(range(size)) if count == 0 or count >= size else _PICKER.sample(range(size), count)

    def _count(self, how: str, checked: int, failed: int) -> None:
        counter = self.rooms.metrics.logprob_checks
        counter.labels(how=how, result="passed").inc(checked - failed)
        counter.labels(how=how, result="failed").inc(failed)


def _forward_done(plan: CheckPlan) -> None:
    """The plan's older groups were recomputed (before the step or inside it): each passed, or is about to be
    dropped, and is never recomputed twice. Under the lock: the flags are shared."""
    for group in plan.forward:
        group.check_logprobs = False


def _gap(group: AcceptedGroup, checked: CheckedGroup, bound: Optional[GapBound]) -> LogprobGap:
    assert bound is not None, "the step checks only the groups the plan gave it a bound for"
    return LogprobGap(group.group_id, checked.mean, checked.worst, bound.mean, bound.token, checked.broke)
