"""Evaluation while training: held-out prompts as eval leases, avg@k and pass@k per round.

Every `train.eval_every` steps (and at step 0 and the final step) a round puts
each held-out prompt up for evaluation. Actors take eval leases before training
leases; each prompt is sampled `train.eval_samples` times (1, greedy, by
default), scored by the run's rewards on the actor, and sent back as ordinary
Rollouts that this room answers. Eval groups never enter the training buffer,
the ledger or the step's counts. With no actor connected, the learner evaluates
the round itself (learner/run/local_eval.py). A round's line goes to metrics.jsonl
(`"event": "eval"`) and its figures to Prometheus. Rounds in flight are not
checkpointed: a resumed run starts with the next one. No sockets here.

Eval leases are sized to the actor's measured speed, as training leases are. An
eval lease that expires puts its prompts back in the round, and is kept while the
round runs: its result, if it comes, scores the prompts nobody has scored yet
(the first result for a prompt wins). A result no round waits for (its round has
finished, or the learner restarted) is answered `stale` (`eval_round_done`),
never judged as a training submission.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Callable, Literal, Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.leasing import (
    DEADLINE_SHARE,
    conversation_of,
    extend_leases,
    max_lease_seconds,
    prompt_item,
    record_speed,
)
from grpo_fleet.learner.evals.eval_checks import EvalChecks
from grpo_fleet.learner.evals.rounds import (
    EvalLease,
    EvalRound,
    eval_group_id,
    eval_lease_size,
    eval_sampling,
    eval_summary,
    names_eval_groups,
    submitted_ids,
)
from grpo_fleet.learner.records.runlog import EvalRecord, RunLog
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Example

if TYPE_CHECKING:
    from grpo_fleet.learner.actors.registry import ActorInfo, Registry
    from grpo_fleet.learner.records.state import LearnerState
    from grpo_fleet.learner.verify.actor_checks import RewardCheck

log = logging.getLogger("grpo_fleet.learner")


class Evaluation:
    """The eval rounds: what is due, leased, returned and written; the caller holds the learner's lock."""

    def __init__(self, cfg: RunConfig, examples: list[Example], prompt_tokens: list[np.ndarray], vocab_size: int,
                 state: LearnerState, registry: Registry, runlog: RunLog, metrics: LearnerMetrics,
                 clock: Callable[[], float] = time.monotonic, reward_check: Optional[RewardCheck] = None) -> None:
        self.reward_check = reward_check  # eval rewards are re-scored like training ones (learner/verify/actor_checks.py)
        self.checks = EvalChecks(cfg, vocab_size, reward_check)
        self.train, self.examples, self.prompt_tokens = cfg.train, examples, prompt_tokens
        self.lease_seconds = cfg.server.lease_seconds
        self.max_lease_seconds = max_lease_seconds(cfg.server)
        self.max_groups_per_lease, self.group_size = cfg.server.max_groups_per_lease, cfg.generation.group_size
        # An eval lease should come back well inside its deadline (its figures are for one version: no staleness).
        self.target_seconds = min(cfg.server.lease_target_seconds or float("inf"), DEADLINE_SHARE * self.lease_seconds)
        self.state, self.registry, self.runlog, self.metrics, self.clock = state, registry, runlog, metrics, clock
        self.current: Optional[EvalRound] = None
        self.waiting: Optional[int] = None  # a step whose round is due while another runs
        self.finished: list[tuple[int, EvalRecord]] = []  # (learner step at finish, round) for the trackers
        self._serial = 0
        self.conversation = conversation_of(cfg)

    @property
    def enabled(self) -> bool:
        return self.train.eval_every > 0 and bool(self.examples) and len(self.prompt_tokens) == len(self.examples)

    def sampling(self) -> m.EvalSampling:
        return eval_sampling(self.train)

    def due(self, step: int, final: bool) -> bool:
        return self.enabled and (step % self.train.eval_every == 0 or final)

    def start(self, step: int, version: int) -> None:
        """Put every held-out prompt up for evaluation at `step`; a round already running finishes first."""
        if self.current is not None:
            self.waiting = step
            return
        self.current = EvalRound(step=step, version=version, started=self.clock(),
                                 pending=deque(range(len(self.examples))))
        self.metrics.eval_rounds.inc()

    def grant(self, actor: ActorInfo, request: m.LeaseRequest) -> Optional[m.Lease]:
        """An eval lease of held-out prompts, or None when none is waiting (then a training lease is due)."""
        round_ = self.current
        if round_ is None or not round_.pending:
            return None
        max_groups = eval_lease_size(request.max_groups, self.max_groups_per_lease, actor.groups_per_second.value,
                                     self.group_size, self.sampling().samples, self.target_seconds)
        now = self.clock()
        lease = EvalLease(lease_id=uuid.uuid4().hex, actor=actor.principal, deadline=now + self.lease_seconds,
                          tickets={}, issued_at=now)
        while round_.pending and len(lease.tickets) < max_groups:
            self._serial += 1
            lease.tickets[eval_group_id(self._serial)] = round_.pending.popleft()
        round_.leases[lease.lease_id] = lease
        self.metrics.eval_leases.inc()
        return m.Lease(lease_id=lease.lease_id, deadline_seconds=self.lease_seconds, policy_version=round_.version,
                       prompts=[prompt_item(g, i, self.prompt_tokens[i], self.examples[i], self.conversation)
                                for g, i in lease.tickets.items()], eval=self.sampling())

    def owns(self, lease_id: str) -> bool:
        """Whether `lease_id` is an eval lease of the running round, open or expired in it."""
        return self.current is not None and self.current.lease(lease_id) is not None

    def claims(self, msg: m.Rollouts) -> bool:
        """Whether this room answers `msg`: a lease it owns, or eval groups no round waits for any more."""
        return self.owns(msg.lease_id) or names_eval_groups(msg)

    def take(self, actor: ActorInfo, msg: m.Rollouts) -> m.Ack:
        """The answer to eval Rollouts (claims() said they are); a complete round is written at once."""
        round_ = self.current
        lease = round_.lease(msg.lease_id) if round_ is not None else None
        if round_ is None or lease is None:
            # Its round has finished (or the learner restarted since): nothing waits for it, and nobody erred.
            self.metrics.rejections.labels(reason=RejectReason.EVAL_ROUND_DONE).inc(len(msg.groups))
            return m.Ack(lease_id=msg.lease_id, status="stale", reason=RejectReason.EVAL_ROUND_DONE,
                         groups={g: "stale" for g in submitted_ids(msg)})
        invalid = self.checks.invalid(lease, actor, msg)
        if invalid is not None:
            self.metrics.rejections.labels(reason=invalid).inc()
            self.registry.record_violation(actor.principal, invalid)
            return m.Ack(lease_id=msg.lease_id, status="invalid", reason=invalid)
        late = round_.leases.pop(msg.lease_id, None) is None
        if late:
            del round_.late[msg.lease_id]
        record_speed(actor, lease.issued_at, len(msg.groups) * self.sampling().samples
                     / self.group_size, self.clock())
        answer = {g.group_id: "eval" if round_.score(lease.tickets[g.group_id], [c.reward for c in g.completions],
                                                     msg.policy_version, late=late) else "duplicate"
                  for g in msg.groups}
        if late:  # its prompts went back when it expired: only what it scored counts
            self.metrics.late_groups.labels(kind="eval").inc(sum(v == "eval" for v in answer.values()))
        else:
            for unscored in msg.unscored:
                round_.retry(lease.tickets[unscored.group_id])
            # Untouched tickets (an actor that returned less than it was given) go back too.
            round_.put_back(index for group_id, index in lease.tickets.items() if group_id not in submitted_ids(msg))
        self.finish()
        # A late result whose prompts others scored first: a duplicate, as in training.
        status: Literal["accepted", "duplicate"] = "duplicate" if answer and "eval" not in answer.values() else "accepted"
        return m.Ack(lease_id=msg.lease_id, status=status, groups={**answer, **{u.group_id: "eval" for u in msg.unscored}})

    def reward_jobs(self, actor: ActorInfo, msg: m.Rollouts) -> list[tuple[m.GroupResult, int]]:
        """The groups `take` would re-score, with their examples; reads the state, changes nothing (under the lock)."""
        lease = self.current.lease(msg.lease_id) if self.current is not None else None
        if self.reward_check is None or lease is None or lease.actor != actor.principal:
            return []
        if any(group_id not in lease.tickets for group_id in submitted_ids(msg)) or self.checks.shape(msg) is not None:
            return []
        return [(g, lease.tickets[g.group_id]) for g in msg.groups]

    def expire(self, still_working: Callable[[str], bool] = lambda key: False) -> None:
        """Extend the eval leases past their deadline of actors `still_working` (leasing.extend_leases); put the
        prompts of the rest back in the round."""
        round_, now = self.current, self.clock()
        if round_ is None:
            return
        extended = extend_leases(round_.leases.values(), now, self.lease_seconds, self.max_lease_seconds, still_working)
        self.metrics.leases_extended.labels(kind="eval").inc(extended)
        for lease_id in [lid for lid, lease in round_.leases.items() if lease.deadline <= now]:
            round_.give_back(lease_id)

    def release_actor(self, principal: str) -> None:
        """An actor went away: its eval prompts go back in the round (its leases are kept, as expired ones are)."""
        round_ = self.current
        if round_ is None:
            return
        for lease_id in [lid for lid, lease in round_.leases.items() if lease.actor == principal]:
            round_.give_back(lease_id)

    def claim_for_learner(self, wait_seconds: float) -> list[int]:
        """The waiting prompts, for the learner to evaluate itself, once the round has waited `wait_seconds`."""
        round_ = self.current
        if round_ is None or not round_.pending or self.clock() - round_.started < wait_seconds:
            return []
        claimed = list(round_.pending)
        round_.pending.clear()
        round_.leases["learner"] = EvalLease("learner", "learner", float("inf"), {f"l{i}": i for i in claimed})
        return claimed

    def record_learner(self, rewards: dict[int, Optional[list[float]]], version: int) -> None:
        """The learner's own results for the prompts it claimed (None: unscorable, left out)."""
        round_ = self.current
        assert round_ is not None
        round_.leases.pop("learner", None)
        for index, samples in rewards.items():
            if index in round_.rewards:  # a late eval lease's result scored it meanwhile: the first one counts
                continue
            if samples is None:
                round_.dropped += 1
                continue
            round_.rewards[index] = samples
            round_.versions.append(version)
            round_.on_learner += 1

    def finish(self) -> Optional[EvalRecord]:
        """Write a complete round's line and gauges, start a waiting one; None while the round runs."""
        round_ = self.current
        if round_ is None or not round_.complete:
            return None
        avg, passed = eval_summary(list(round_.rewards.values()), self.train.eval_pass_reward)
        sampling = self.sampling()
        record = EvalRecord(
            step=round_.step, policy_version=round_.version, eval_reward=avg, eval_pass_at_k=passed,
            k=sampling.samples, mode=self.train.eval_mode, prompts=len(self.examples), scored=len(round_.rewards),
            dropped=round_.dropped, on_learner=round_.on_learner,
            sampled_version_min=min(round_.versions, default=round_.version),
            sampled_version_max=max(round_.versions, default=round_.version),
            seconds=self.clock() - round_.started,
        )
        self.runlog.eval(record)
        self.finished.append((self.state.step, record))
        if avg is not None and passed is not None:
            self.metrics.eval_reward.set(avg)
            self.metrics.eval_pass_at_k.set(passed)
        log.info("eval at step %d: avg@%d %s, pass@%d %s over %d prompts (%.1fs)", record.step, record.k, avg,
                 record.k, passed, record.scored, record.seconds)
        self.current = None
        if self.waiting is not None:
            self.waiting = None
            self.start(self.state.step, self.state.version)
        return record
