"""The actor's single-turn leases through one rolling batch: a slot that finishes takes new work at once.

One turn of the worker's loop (`LeaseStream.turn`): queue the lease in hand if
the batch wants work and the loaded version may still start work, and ask for
the next one at once; decode one step; score and queue each lease that
finished; send the oldest finished lease when no submission awaits its answer;
read the answers that came meanwhile, without waiting. The link's protocol is
kept: one lease request and one submission unanswered at a time.

Versions stay exact (actor/rolling.py): new work starts at the loaded version
only while it lags the learner's by little enough (`may_refill`: at the
default grpo.max_staleness of 2, only at the learner's own version). Past
that, the batch drains: nothing new goes in, what is in flight finishes at its
version and is submitted, and only then (`idle`) does the worker load the new
weights. An eval lease samples its own way, so the batch drains before it and
it runs alone, as every lease did before. Both drains are counted with their
idle slots (`drains`, `drain_idle_slots`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional, Protocol

import mlx.core as mx
from pydantic import BaseModel

from grpo_fleet.actor import wire
from grpo_fleet.actor.pipeline import InFlight
from grpo_fleet.actor.rolling import FinishedLease, RollingGenerator, may_refill
from grpo_fleet.models.generation import GeneratedCompletion
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import ActorMetrics
from grpo_fleet.protocol import messages as m

# mlx-lm's own default: more rows than this per decoding step gain little and hold more KV cache.
MAX_BATCH_SIZE = 64


class StreamLink(Protocol):
    """What the stream needs from the link: send, read what came, wait for an answer, heartbeat."""

    def send(self, msg: BaseModel) -> None: ...

    def take_answers(self) -> None: ...

    def await_answers(self, settled: Callable[[], bool]) -> None: ...

    def heartbeat(self, policy_version: int, every_seconds: float) -> None: ...


# How a finished lease is scored (RunRewards.score): its items, its groups, the tokenizer, the metrics.
Score = Callable[[list[m.PromptItem], list[list[GeneratedCompletion]], Any, ActorMetrics],
                 tuple[list[m.GroupResult], list[m.UnscoredGroup]]]


class Turn(NamedTuple):
    """What the worker knows at the start of a turn."""

    welcome: m.Welcome
    policy: Policy
    loaded: int  # the version in the model
    newest: int  # the learner's, as last announced
    stopping: bool  # deliver what is in hand, ask for nothing new


class LeaseStream:
    """Leases in, Rollouts out, through one rolling batch kept across leases (until the model or settings change)."""

    def __init__(self, link: StreamLink, inflight: InFlight, metrics: ActorMetrics, max_groups: int,
                 alone: Callable[[m.Lease], m.Rollouts], score: Score) -> None:
        self.link, self.inflight, self.metrics, self.max_groups = link, inflight, metrics, max_groups
        self._alone, self._score = alone, score  # an eval lease, run on its own; the rewards
        self.rolling: Optional[RollingGenerator[m.Lease]] = None
        self.draining: Optional[str] = None  # why nothing new goes in ("version", "eval"), until idle
        # lease id -> (when it was queued, the learner's life then): a Rollouts names the life its version is of
        self._begun: dict[str, tuple[float, str]] = {}
        self._retry_at = 0.0  # after an empty lease: when to ask again
        self._slots = self._rows = 0  # over the actor's life, for the idle-slot gauge
        self._drains = {"version": 0, "eval": 0}
        self._drain_idle = 0

    @property
    def idle(self) -> bool:
        """Nothing decoding: weights may be swapped."""
        return self.rolling is None or self.rolling.idle

    def summary(self) -> str:
        """The batch's use over this actor's life, for its last log line."""
        idle = 1.0 - self._rows / self._slots if self._slots else 0.0
        return (f"{self._rows} tokens in {self._slots} slot-steps ({100 * idle:.1f}% idle); drains {self._drains}, "
                f"{self._drain_idle} idle slot-steps while draining")

    def reset(self) -> None:
        """The model changed under us: what was decoding is dropped (the learner re-queues its leases)."""
        if self.rolling is not None:
            self.rolling.close()
        self.rolling, self.draining = None, None
        self.inflight.generating.clear()
        self._begun.clear()

    def turn(self, now: Turn) -> None:
        """One step of work; blocks only when nothing decodes and there is nothing to do but wait."""
        self._feed(now)
        if not self.idle:
            self._decode(now)
        else:
            self._wait(now)
        if (rollouts := self.inflight.submit_next()) is not None:
            self.link.send(rollouts)
        self.link.take_answers()

    # ------------------------------------------------------------------ leases in

    def _feed(self, now: Turn) -> None:
        """Queue the lease in hand if it may start now; ask for the next one as soon as it is taken."""
        lease = self.inflight.next_lease
        if lease is None:
            if not (self.inflight.lease_requested or now.stopping) and time.monotonic() >= self._retry_at:
                self._request()
            return
        if not lease.prompts:  # nothing to do now: ask again after retry_after
            self.inflight.take_lease()
            self._retry_at = time.monotonic() + lease.retry_after
            return
        if lease.eval is not None or not may_refill(now.loaded, now.newest, now.welcome.max_staleness):
            self._drain_for(lease, now)
            return
        if self.rolling is not None and not self.rolling.wants_work:
            return
        self.inflight.take_lease()
        self._insert(lease, now)

    def _drain_for(self, lease: m.Lease, now: Turn) -> None:
        """An eval lease runs alone once the batch is empty; a stale version waits for the worker's sync."""
        reason = "eval" if lease.eval is not None else "version"
        if not self.idle:
            if self.draining is None:
                self.draining = reason
                self._drains[reason] += 1
                self.metrics.drains.labels(reason=reason).inc()
            return
        self.draining = None
        if lease.eval is not None:
            self.inflight.take_lease()
            self._ask_unless(now.stopping)
            self.inflight.finished.append(self._alone(lease))

    def _insert(self, lease: m.Lease, now: Turn) -> None:
        settings = wire.sampling_settings(now.welcome.generation, now.policy.tokenizer.eos_token_ids)
        if self.rolling is not None and self.rolling.settings != settings:  # a new run's: only ever when idle
            self.reset()
        if self.rolling is None:
            size = min(MAX_BATCH_SIZE, self.max_groups * settings.group_size)
            self.rolling = RollingGenerator(now.policy.model, settings, size)
        self.rolling.add(lease, wire.lease_prompts(lease), now.loaded)
        self.draining = None  # new work goes in: whatever drain there was has ended
        self.inflight.generating.add(lease.lease_id)
        self._begun[lease.lease_id] = (time.perf_counter(), now.welcome.incarnation)
        self._ask_unless(now.stopping)

    def _ask_unless(self, stopping: bool) -> None:
        if not (stopping or self.inflight.lease_requested or self.inflight.next_lease is not None):
            self._request()

    def _request(self) -> None:
        self.link.send(m.LeaseRequest(max_groups=self.max_groups))
        self.inflight.lease_requested = True

    # ------------------------------------------------------------------ decoding and Rollouts out

    def _decode(self, now: Turn) -> None:
        assert self.rolling is not None  # not idle
        usage = self.rolling.usage
        idle_before = usage.idle_slots
        slots_before, rows_before = usage.slots, usage.rows
        finished = self.rolling.step(lambda: self.link.heartbeat(now.loaded, now.welcome.heartbeat_seconds))
        self._slots += usage.slots - slots_before
        self._rows += usage.rows - rows_before
        self.metrics.idle_slots.set(1.0 - self._rows / self._slots)
        if self.draining is not None:
            self._drain_idle += usage.idle_slots - idle_before
            self.metrics.drain_idle_slots.inc(usage.idle_slots - idle_before)
        for lease in finished:
            self._finish(lease, now)

    def _finish(self, done: FinishedLease[m.Lease], now: Turn) -> None:
        """Score a finished lease and queue it for submission (dropped if its run was forgotten meanwhile)."""
        lease = done.key
        begun, incarnation = self._begun.pop(lease.lease_id)
        self.metrics.generation_seconds.observe(time.perf_counter() - begun)
        if lease.lease_id not in self.inflight.generating:
            return
        self.inflight.generating.discard(lease.lease_id)
        scored, unscored = self._score(list(lease.prompts), done.groups, now.policy.tokenizer, self.metrics)
        self.metrics.peak_memory.set(mx.get_peak_memory())
        self.inflight.finished.append(m.Rollouts(
            lease_id=lease.lease_id, policy_version=done.version, incarnation=incarnation, groups=scored,
            unscored=unscored))

    def _wait(self, now: Turn) -> None:
        """Nothing decodes: wait for what can unblock us (an Ack for a finished lease, or the next lease)."""
        if self.inflight.finished and self.inflight.submitted is not None:
            self.link.await_answers(lambda: self.inflight.submitted is None)
        elif self.inflight.lease_requested and self.inflight.next_lease is None:
            self.link.await_answers(lambda: self.inflight.next_lease is not None)
        elif self.inflight.next_lease is None and not self.inflight.finished and now.stopping:
            self.link.await_answers(lambda: self.inflight.submitted is None)
        elif self.inflight.next_lease is None and not self.inflight.lease_requested:
            time.sleep(max(0.0, min(0.05, self._retry_at - time.monotonic())))
