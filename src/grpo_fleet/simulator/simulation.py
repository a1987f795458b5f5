"""The discrete-event model of one run: actors lease, generate and submit; the learner buffers and steps.

The rules are the learner's own (`learner.actors.leasing`): leases are sized so an
actor returns one within `max_staleness` learner steps, no lease is granted
while leased-out plus buffered groups reach `in_flight_steps x groups_per_step`,
a refused actor asks again after `retry_after`, and a group sampled more than
`max_staleness` versions behind the policy it reaches is rejected (its prompt
goes back to the queue).

The logprob check is the learner's own too (`learner.verify.trust.Trust`, with a
seeded draw): a group sampled at the version the step trains from is checked
inside the step's forward, for nothing; an older one is recomputed at its own
version when drawn (every group of an actor on probation, then a random share),
by the rank that trains it, or all on rank 0 (`specs.CheckSpec.spread`).

At drawn completion lengths (`ActorSpec.lengths`) a lease costs what
`decoding` says, a refilling actor keeps its loaded weights as long as the
actor's own rule allows (`actor.rolling.may_refill`), and a step pays its
groups' real tokens plus a share of their padding (`RunSpec.padding`).

Processes run on machines of their own (a fleet of Macs), or on one shared
host (`SharedHost`, how the check on this VM runs): there every busy process
wants some cores, and when they want more than the host has, each runs slower
by the same factor (processor sharing). What is left out on purpose: network
latency (ms against seconds of generation), reward time, and eval rounds.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from grpo_fleet.actor.rolling import may_refill
from grpo_fleet.learner.actors.leasing import (
    in_flight_limit,
    lease_size,
    lease_target_seconds,
    retry_after,
)
from grpo_fleet.learner.actors.rates import MovingAverage
from grpo_fleet.learner.verify.trust import Trust
from grpo_fleet.simulator.decoding import Decoding, SampledGroup
from grpo_fleet.simulator.jobs import SharedJobs
from grpo_fleet.simulator.specs import ActorSpec, RunSpec, SharedHost, SimResult

LEARNER = -1


@dataclass(frozen=True)
class _Buffered:
    """One accepted group: the version it was sampled at, its actor, and whether the learner drew it for a check."""

    version: int
    actor: int
    drawn: bool
    sampled: SampledGroup = SampledGroup(0, 0, 0)


@dataclass
class _Learner:
    version: int = 0
    buffer: list[_Buffered] = field(default_factory=list)
    busy: bool = False
    leased_out: int = 0
    informative_credit: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    step_starts: list[float] = field(default_factory=list)  # checks included: when the training thread took it
    interval: MovingAverage = field(default_factory=MovingAverage)
    trained_staleness: list[int] = field(default_factory=list)
    checked: list[tuple[int, int, float]] = field(default_factory=list)  # each step's (fused, forwards, seconds)
    checker_free_at: float = 0.0
    arrival_staleness: list[int] = field(default_factory=list)
    arrived_tokens: list[tuple[float, int]] = field(default_factory=list)  # (when, completion tokens) a submission


class FleetSimulation:
    """Events in time order: an actor asking for a lease, an actor finishing one, the learner finishing a step."""

    def __init__(self, actors: list[ActorSpec], run: RunSpec, host: Optional[SharedHost] = None) -> None:
        self.actors, self.run, self.host = actors, run, host
        self.learner = _Learner()
        self.clock = SharedJobs(host)
        self.actor_versions = [0] * len(actors)
        self.actor_busy = [0.0] * len(actors)
        # Each actor's groups/s as the learner measures it from returned leases (leasing.Leasing.measure): it
        # sizes the next leases, and a lease's cost is not proportional to its groups (ActorSpec.lease_seconds).
        self.rates = [MovingAverage() for _ in actors]
        self.pending: list[Optional[int]] = [None] * len(actors)  # the next lease, granted while generating
        # Refused actors. Real ones poll every retry_after (at most 0.2 s); here they are woken when room
        # frees instead, which costs the same time without an event per poll over an hour-long step.
        self.waiting: list[int] = []
        self.submitted = self.rejected = 0
        self.rules = run.rules
        self.limit = in_flight_limit(self.rules.in_flight_steps, self.rules.groups_per_step)
        check = run.check
        self.trust = Trust(check.probation_groups, check.share, draw=random.Random(check.seed))
        self.decoding = Decoding(actors, run.length_seed)
        self.arriving: deque[list[SampledGroup]] = deque()  # submissions' lengths, in their "accept" events' order

    def run_to_end(self) -> SimResult:
        for index in range(len(self.actors)):
            self.clock.at(0.0, "ask", index)
        while len(self.learner.step_ends) < self.run.steps and self.clock.events:
            kind, index, a, b = self.clock.pop()
            if kind == "ask":
                self._ask_idle(index)
            elif kind == "accept":
                self._accept(index, a, b)
            elif self.clock.is_newest_finish(index, a):
                self._finish(index)
        return self._result()

    def _finish(self, key: int) -> None:
        job = self.clock.end(key)
        if key == LEARNER:
            self.learner.step_starts.append(job.started)
            self._finish_step()
        else:
            self.actor_busy[key] += self.clock.now - job.started
            self.rates[key].add(job.groups / max(self.clock.now - job.started, 1e-3))
            self._submit(key, job.groups, job.version, job.sampled)

    # ------------------------------------------------------------------ actors

    def _grant(self, index: int) -> int:
        """Groups leased to actor `index` now, sized as the learner sizes them (0: refused)."""
        actor, learner, rules = self.actors[index], self.learner, self.rules
        capacity = max(0, self.limit - learner.leased_out - len(learner.buffer))
        target = lease_target_seconds(None, rules.max_staleness, learner.interval.value, rules.lease_seconds)
        count = lease_size(actor.max_groups, min(rules.max_groups_per_lease, capacity), self.rates[index].value,
                           target)
        learner.leased_out += count
        return count

    def _ask_idle(self, index: int) -> None:
        """An actor with nothing to generate asks; refused, it asks again after `retry_after`."""
        count = self._grant(index)
        if count:
            self._start(index, count)
        else:
            self.waiting.append(index)

    def _wake_waiting(self) -> None:
        """Room freed (a batch left the buffer, or groups were not kept): the refused actors ask again."""
        delay = retry_after(self.learner.interval.value, False)
        for index in self.waiting:
            self.clock.at(self.clock.now + delay, "ask", index)
        self.waiting = []

    def _start(self, index: int, count: int) -> None:
        """Generate a lease on the weights `_weights` picks; the next lease is asked for at once (the actor
        pipelines)."""
        actor = self.actors[index]
        fetch, version = self._weights(index)
        cores = self.host.actor_cores if self.host is not None else 1.0
        decode, sampled = self.decoding.lease(index, count)
        self.clock.begin(index, fetch + actor.lease_seconds + decode, cores, count, version, sampled)
        self.pending[index] = self._grant(index)

    def _weights(self, index: int) -> tuple[float, int]:
        """(fetch seconds, version) of the lease actor `index` starts now: the newest weights, fetched if they are
        new. A refilling actor whose rows still decode keeps its loaded weights while the actor's own rule
        (`actor.rolling.may_refill`) lets new work start at them; past it, its batch drains first."""
        actor, newest, loaded = self.actors[index], self.learner.version, self.actor_versions[index]
        if actor.refill and self.decoding.refilling(index):
            if may_refill(loaded, newest, self.rules.max_staleness):
                return 0.0, loaded
            self.decoding.wait(index)  # no new work until the batch is empty: its rows idle out the tail
        self.actor_versions[index] = newest
        return (actor.fetch_seconds if loaded < newest else 0.0), newest

    def _submit(self, index: int, groups: int, version: int, sampled: list[SampledGroup]) -> None:
        """Rollouts reach the learner's verifier; the actor goes on with the lease it was already granted."""
        learner = self.learner
        cost = groups * self.run.answer_seconds_per_group
        learner.checker_free_at = max(self.clock.now, learner.checker_free_at) + cost
        if LEARNER in self.clock.jobs and cost > 0:
            self.clock.extend(LEARNER, cost)
        self.clock.at(learner.checker_free_at, "accept", index, groups, version)
        self.arriving.append(sampled)  # accept events come due in the order they are scheduled
        pending, self.pending[index] = self.pending[index], None
        if pending:
            self._start(index, pending)
        else:  # the pipelined request was refused: the actor read that when this lease ended, and waits
            self.decoding.wait(index)
            self.clock.at(self.clock.now + retry_after(learner.interval.value, False), "ask", index)

    # ------------------------------------------------------------------ the learner

    def _accept(self, actor: int, groups: int, version: int) -> None:
        """The verdict: too stale is rejected (the prompts go back); the informative rest are buffered, each
        drawn for the logprob check or not as the learner's Trust draws it."""
        learner, rules = self.learner, self.rules
        learner.leased_out -= groups
        self.submitted += groups
        sampled = self.arriving.popleft()
        learner.arrival_staleness.extend([learner.version - version] * groups)
        learner.arrived_tokens.append((self.clock.now, sum(group.tokens for group in sampled)))
        if learner.version - version > rules.max_staleness:
            self.rejected += groups  # re-queued on the learner: the prompts come back, the work is lost
        else:
            learner.informative_credit += groups * self.run.informative_fraction
            whole = int(learner.informative_credit + 1e-9)
            learner.informative_credit -= whole
            key = str(actor)
            learner.buffer.extend(_Buffered(version, actor, self.run.check.enabled and self.trust.wants_check(key),
                                            sampled[i % len(sampled)] if sampled else SampledGroup(0, 0, 0))
                                  for i in range(whole))
        self._maybe_step()
        self._wake_waiting()

    def _maybe_step(self) -> None:
        learner, size = self.learner, self.rules.groups_per_step
        if LEARNER in self.clock.jobs or len(learner.buffer) < size:
            return
        batch, learner.buffer = learner.buffer[:size], learner.buffer[size:]
        learner.trained_staleness.extend(learner.version - group.version for group in batch)
        checks = self._check_seconds(batch)
        self._wake_waiting()
        cores = self.host.learner_cores if self.host is not None else 1.0
        self.clock.begin(LEARNER, checks + self.run.step_seconds + token_seconds(self.run, batch), cores)

    def _check_seconds(self, batch: list[_Buffered]) -> float:
        """The step's own check of `batch`: free at the version it trains from, a forward for a drawn older group,
        shared by the ranks whose rows hold it or, unspread, all on rank 0. Every checked group counts towards its
        actor's probation."""
        check = self.run.check
        if not check.enabled:
            self.learner.checked.append((0, 0, 0.0))
            return 0.0
        fused = [g for g in batch if g.version == self.learner.version]
        forwards = [g for g in batch if g.version != self.learner.version and g.drawn]
        for group in fused + forwards:
            self.trust.record_pass(str(group.actor))
        # Spread, the rows are dealt to the ranks in turn (learner/ranks/sharding.py), so a drawn group's picked
        # completions land on any rank: the ranks share the forwards about evenly, and the step waits for them.
        sharing = self.run.ranks if check.spread else 1
        seconds = len(forwards) * check.forward_seconds * check.completions / sharing
        self.learner.checked.append((len(fused), len(forwards), seconds))
        return seconds

    def _finish_step(self) -> None:
        learner = self.learner
        if learner.step_ends:
            learner.interval.add(self.clock.now - learner.step_ends[-1])
        learner.step_ends.append(self.clock.now)
        learner.version += 1
        self._maybe_step()

    def _result(self) -> SimResult:
        ends, learner = self.learner.step_ends, self.learner
        first = self.run.measure_from if self.run.measure_from is not None else len(ends) // 2
        if len(ends) < 4 or first >= len(ends) - 1:
            return SimResult(0.0, 0.0, 0.0, 0.0, 0.0)
        span = ends[-1] - ends[first]
        steps_per_second = (len(ends) - 1 - first) / span if span > 0 else float("inf")
        staleness = learner.trained_staleness
        trained = max(1, len(learner.checked) * self.rules.groups_per_step)
        return SimResult(
            steps_per_second=steps_per_second,
            learner_busy_fraction=busy_share(learner.step_starts, ends, ends[first], ends[-1]),
            actor_busy_fraction=sum(self.actor_busy) / (len(self.actors) * ends[-1]),
            stale_fraction=self.rejected / max(1, self.submitted),
            mean_staleness=sum(staleness) / max(1, len(staleness)),
            fused_fraction=sum(c[0] for c in learner.checked) / trained,
            forward_fraction=sum(c[1] for c in learner.checked) / trained,
            check_seconds_per_step=sum(c[2] for c in learner.checked) / max(1, len(learner.checked)),
            staleness_p90=percentile(staleness, 0.9),
            arrival_staleness=sum(learner.arrival_staleness) / max(1, len(learner.arrival_staleness)),
            idle_slot_fraction=self.decoding.idle_fraction(),
            rollout_tokens_per_second=sum(t for when, t in learner.arrived_tokens if ends[first] < when <= ends[-1])
            / span if span > 0 else 0.0,
        )


def token_seconds(run: RunSpec, batch: list[_Buffered]) -> float:
    """A step's cost of its tokens at drawn lengths: prompt and completion rows, plus the share of the
    padding to the batch's longest completion that the step pays (RunSpec.padding)."""
    if run.seconds_per_token == 0.0:
        return 0.0
    groups = [group.sampled for group in batch]
    real = sum(g.rows * run.prompt_tokens + g.tokens for g in groups)
    longest = max((g.longest for g in groups), default=0)
    padded = sum(g.rows * (run.prompt_tokens + longest) for g in groups)
    return run.seconds_per_token * (real + run.padding * (padded - real))


def busy_share(step_starts: list[float], step_ends: list[float], start: float, end: float) -> float:
    """Share of [start, end] the learner spent on steps and their checks (at its shared speed, if any)."""
    busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in zip(step_starts, step_ends))
    return busy / (end - start) if end > start else 1.0


def percentile(values: list[int], share: float) -> float:
    """The nearest-rank percentile: the smallest value at least `share` of `values` are at or below (0: none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(share * len(ordered)) - 1)])


def simulate(actors: list[ActorSpec], run: RunSpec, host: Optional[SharedHost] = None) -> SimResult:
    """Steady-state steps/s and utilisation of `actors` feeding a learner shaped by `run`, on machines of
    their own or on one `host`."""
    return FleetSimulation(actors, run, host).run_to_end()

