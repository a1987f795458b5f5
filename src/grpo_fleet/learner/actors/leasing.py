"""Leases out: how many groups to hand an actor, how much may be in flight, when to ask again.

The learner measures each actor's groups per second from its returned leases and
its own step interval, and sizes every lease so that it comes back within a
target time. A fast Mac gets big leases, a slow one small leases, so a slow Mac
never holds prompts the step is waiting for, and its groups come back before
they are too stale to use. The sizing is pure functions; `Leasing` applies them
to the scheduler's bookkeeping (records/lease_book.py). No sockets.

Each actor key may hold at most what its sessions can finish within a lease's
timeout at their measured speed (`actor_cap`), so one actor, honest but slow or
hoarding on purpose, cannot take the whole in-flight budget from the others; and
never more than its fair share of that budget plus one lease (`key_share`),
whatever speed it shows or sessions it opens (at most
server.max_sessions_per_key). Speed counts only the groups the learner accepted:
a lease returned unscored or stale can only slow an actor's measure; and a
return is never read as faster than MIN_MEASURED_SECONDS allows, nor as more
than MAX_SPEEDUP times the actor's current measure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np

from grpo_fleet.config import RunConfig, ServerConfig
from grpo_fleet.learner.actors.rates import MovingAverage
from grpo_fleet.learner.actors.registry import ActorInfo
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import Example, prompt_text, reward_kwargs
from grpo_fleet.tasks.prompts import chat_messages

if TYPE_CHECKING:
    from grpo_fleet.learner.records.state import LearnerState

# A lease should come back well before it expires and is re-queued.
DEADLINE_SHARE = 0.5
# Bounds on how long an actor refused a lease waits before asking again.
MIN_RETRY_SECONDS, MAX_RETRY_SECONDS = 0.005, 0.2
# What an actor not measured yet may hold, in leases: it asks for the next one while it generates the current one.
NEW_ACTOR_LEASES = 2
# Longest a lease is held while its actor is still at work, in lease_seconds (unless server.max_lease_seconds).
DEFAULT_LEASE_SPANS = 3
# The shortest time a returned lease is measured over: about what the tests' tiny model takes for a group (a real
# model takes seconds); a return sent at once must not read as thousands of groups per second.
MIN_MEASURED_SECONDS = 0.01
# One return may read as at most this many times the actor's current speed: a fast actor ramps up over a few
# leases (its moving average grows at most 1 + EMA_WEIGHT x (MAX_SPEEDUP - 1) = 1.3x per return).
MAX_SPEEDUP = 2.0
# ... of its current speed or of this many groups per second, whichever is more: a measure near 0 (nothing
# accepted lately) can climb again.
SPEEDUP_BASE = 1.0


def lease_target_seconds(
    fixed: Optional[float], max_staleness: int, step_interval: Optional[float], lease_seconds: float
) -> Optional[float]:
    """How long a lease should take its actor; None while nothing bounds it yet.

    Unless the user fixed it, a lease should return within `max_staleness` learner
    steps (at least one), so its groups are still fresh enough to be accepted.
    """
    if fixed is not None:
        target = fixed
    elif step_interval is not None:
        target = max(1, max_staleness) * step_interval
    else:
        return None
    return min(target, DEADLINE_SHARE * lease_seconds)


def lease_size(
    requested: int, limit: int, groups_per_second: Optional[float], target_seconds: Optional[float]
) -> int:
    """Groups to lease: what the actor can finish in `target_seconds`, within `requested` and `limit`.

    `limit` is the learner's own bound (per-lease maximum and free capacity). An
    actor not measured yet gets what it asked for (its own `max_groups`); a
    measured one gets at least one group, so every actor keeps contributing.
    """
    upper = min(requested, limit)
    if upper < 1:
        return 0
    if groups_per_second is None or target_seconds is None:
        return upper
    return max(1, min(upper, math.floor(groups_per_second * target_seconds)))


def actor_cap(groups_per_second: Optional[float], lease_seconds: float, max_groups_per_lease: int) -> int:
    """Most groups one actor session may hold at once: what it finishes within a lease's timeout at its measured
    speed (at least one, so a slow actor still contributes); before its first measurement, NEW_ACTOR_LEASES
    full leases."""
    if groups_per_second is None:
        return NEW_ACTOR_LEASES * max_groups_per_lease
    return max(1, math.floor(groups_per_second * lease_seconds))


def key_share(limit: int, keys: int, max_groups_per_lease: int) -> int:
    """Most groups one key may hold at once: an equal share of the in-flight `limit` among the `keys` with a live
    session, plus one lease (so every key can work, and a lone key has the whole budget)."""
    return limit // max(1, keys) + max_groups_per_lease


def speed_sample(groups: float, seconds: float, current: Optional[float]) -> float:
    """Groups per second of one return: over at least MIN_MEASURED_SECONDS, and at most MAX_SPEEDUP times
    `current` (the actor's measure so far, None before the first; SPEEDUP_BASE if more)."""
    sample = groups / max(seconds, MIN_MEASURED_SECONDS)
    return sample if current is None else min(sample, MAX_SPEEDUP * max(current, SPEEDUP_BASE))


def record_speed(actor: ActorInfo, issued_at: float, groups: float, now: float,
                 most: Optional[float] = None) -> None:
    """Add one returned lease's groups per second, at most `most`, to `actor`'s measure (`Leasing.measure` says
    when it starts and what `most` is)."""
    if not groups:
        return
    started = max(issued_at, actor.last_return if actor.last_return is not None else issued_at)
    sample = speed_sample(groups, now - started, actor.groups_per_second.value)
    actor.groups_per_second.add(sample if most is None else min(sample, most))
    actor.last_return = now


def unmeasured_speed(lease_seconds: float, max_groups_per_lease: int) -> float:
    """The speed whose `actor_cap` is an unmeasured actor's: work not accepted never reads as faster."""
    return NEW_ACTOR_LEASES * max_groups_per_lease / lease_seconds


class HeldLease(Protocol):
    """What extending a lease reads and moves: a training lease (records/tickets.py) or an eval lease alike."""

    actor: str
    deadline: float
    issued_at: float


def max_lease_seconds(server: ServerConfig) -> float:
    return server.max_lease_seconds or DEFAULT_LEASE_SPANS * server.lease_seconds


def extend_leases(leases: Iterable[HeldLease], now: float, lease_seconds: float, max_seconds: float,
                  still_working: Callable[[str], bool]) -> int:
    """Give each lease past its deadline whose actor is `still_working` another `lease_seconds`, never past
    `max_seconds` after it was issued; returns how many were extended (the others expire as before).

    A long answer's lease can outlive its deadline while its actor decodes on: re-queuing it then has another
    actor do the same groups, and one of the two results is thrown away. The cap bounds what a hoarder holds.
    """
    extended = 0
    for lease in leases:
        deadline = min(lease.deadline + lease_seconds, lease.issued_at + max_seconds)
        if lease.deadline <= now < deadline and still_working(lease.actor):
            lease.deadline = deadline
            extended += 1
    return extended


def in_flight_limit(in_flight_steps: int, groups_per_step: int) -> int:
    """Most groups leased out plus accepted-but-untrained at once (`server.in_flight_steps` says what it bounds)."""
    return in_flight_steps * groups_per_step


def retry_after(step_interval: Optional[float], done: bool) -> float:
    """How long a refused actor waits: capacity frees when the next step takes its batch, about one step away."""
    if done or step_interval is None:
        return MAX_RETRY_SECONDS
    return min(MAX_RETRY_SECONDS, max(MIN_RETRY_SECONDS, 0.5 * step_interval))


class Leasing:
    """Grants leases from the scheduler, sized to each actor and to the room left in flight."""

    def __init__(self, cfg: RunConfig, state: LearnerState, metrics: LearnerMetrics,
                 prompt_tokens: list[np.ndarray], examples: list[Example],
                 sessions: Callable[[str], list[ActorInfo]] = lambda key: [],
                 keys: Callable[[], int] = lambda: 1) -> None:
        self.server, self.state, self.metrics = cfg.server, state, metrics
        self.sessions = sessions  # the live sessions under a key (registry.sessions_of): the key's cap is theirs
        self.keys = keys  # how many keys have a live session (registry.key_count): they share the budget
        self.limit = in_flight_limit(cfg.server.in_flight_steps, cfg.grpo.groups_per_step)
        self.max_staleness = cfg.grpo.max_staleness
        self.prompt_tokens, self.examples = prompt_tokens, examples
        self.conversation = conversation_of(cfg)
        self.step_interval = MovingAverage()  # seconds between learner steps
        self._last_step_at: Optional[float] = None

    def capacity(self) -> int:
        """Groups that may still be leased: the in-flight limit less what is out or buffered."""
        return max(0, self.limit - self.state.scheduler.outstanding_groups - len(self.state.buffer))

    def room_for(self, actor: ActorInfo) -> tuple[int, str]:
        """Groups `actor`'s key may still take, and what bounds them: its sessions' caps (`actor_cap`) or its share
        of the budget (`key_share`), whichever is less, less what the key holds."""
        server = self.server
        sessions = self.sessions(actor.principal) or [actor]
        cap = sum(actor_cap(s.groups_per_second.value, server.lease_seconds, server.max_groups_per_lease)
                  for s in sessions)
        share = key_share(self.limit, self.keys(), server.max_groups_per_lease)
        held = self.state.scheduler.ledger.groups_held(actor.principal)
        return (cap - held, "actor_cap") if cap <= share else (share - held, "fair_share")

    def grant(self, actor: ActorInfo, request: m.LeaseRequest) -> m.Lease:
        """A lease for `actor`, or an empty one telling it when to ask again."""
        state = self.state
        room, bound = self.room_for(actor)
        if room < 1 and not state.done:
            self.metrics.fair_share_refusals.labels(reason=bound).inc()
        limit = min(self.server.max_groups_per_lease, self.capacity(), room)
        count = lease_size(request.max_groups, limit, actor.groups_per_second.value, self.target_seconds())
        lease = state.scheduler.issue(actor.principal, count) if count and not state.done else None
        if lease is None:
            return m.Lease(lease_id="", deadline_seconds=0.0, policy_version=state.version, prompts=[],
                           retry_after=retry_after(self.step_interval.value, state.done))
        self.metrics.leases_issued.inc()
        self.metrics.lease_groups.observe(len(lease.tickets))
        self.metrics.leases_outstanding.set(len(state.scheduler.ledger.leases))
        prompts = [self._prompt_item(t.group_id, t.prompt_index) for t in lease.tickets.values()]
        return m.Lease(lease_id=lease.lease_id, deadline_seconds=self.server.lease_seconds,
                       policy_version=state.version, prompts=prompts)

    def target_seconds(self) -> Optional[float]:
        return lease_target_seconds(self.server.lease_target_seconds, self.max_staleness,
                                    self.step_interval.value, self.server.lease_seconds)

    def issued_at(self, lease_id: str) -> Optional[float]:
        """When an open or late lease was issued (None for one nobody remembers); read before its groups are
        taken, as a lease whose every group is finished is forgotten."""
        scheduler = self.state.scheduler
        # A late lease is measured too: it is the one that says the actor is slower than its leases assumed.
        lease = scheduler.ledger.leases.get(lease_id) or scheduler.ledger.late.get(lease_id)
        return None if lease is None else lease.issued_at

    def measure(self, actor: ActorInfo, issued_at: Optional[float], accepted: int, returned: int) -> None:
        """Groups per second of a returned lease issued at `issued_at`, for sizing the next ones: its `accepted`
        groups; or if none was, its `returned` ones, which may only slow the measure (or, before the first, set
        it no faster than `unmeasured_speed`): one key cannot read as fast by sending back work it never did,
        and an honest one whose work comes back stale is still measured slower, so its leases shrink.

        The clock starts when the lease was issued or when the actor's previous
        lease came back, whichever is later: actors ask for their next lease
        before generating the current one, and it waits in hand meanwhile.
        """
        if issued_at is None:
            return
        current = actor.groups_per_second.value
        most = None if accepted else (
            current if current is not None else unmeasured_speed(self.server.lease_seconds,
                                                                 self.server.max_groups_per_lease))
        record_speed(actor, issued_at, accepted or returned, self.state.scheduler.clock(), most)

    def step_finished(self) -> None:
        """Time the learner's steps: leases are sized in steps, and refused actors retry in about half of one."""
        now = time.monotonic()
        if self._last_step_at is not None:
            self.step_interval.add(now - self._last_step_at)
        self._last_step_at = now

    def expire(self, still_working: Callable[[str], bool] = lambda key: False) -> int:
        """Extend the leases past their deadline of actors `still_working` (`extend_leases`), re-queue the rest;
        returns how many expired."""
        scheduler = self.state.scheduler
        extended = extend_leases(scheduler.ledger.leases.values(), scheduler.clock(), self.server.lease_seconds,
                                 max_lease_seconds(self.server), still_working)
        self.metrics.leases_extended.labels(kind="train").inc(extended)
        expired = scheduler.expire()
        if expired:
            self.metrics.leases_expired.inc(len(expired))
            self.metrics.leases_outstanding.set(len(self.state.scheduler.ledger.leases))
        return len(expired)

    def _prompt_item(self, group_id: str, index: int) -> m.PromptItem:
        return prompt_item(group_id, index, self.prompt_tokens[index], self.examples[index], self.conversation)


Conversation = Callable[[Example], Optional[list[dict[str, Any]]]]


def conversation_of(cfg: RunConfig) -> Conversation:
    """What a leased prompt's `messages` are: in a run with an environment, the conversation its tokens render
    (system prompt included), which env.init gets; else nothing (the actor has no use for it)."""
    system_prompt = cfg.task.system_prompt

    def episode(example: Example) -> Optional[list[dict[str, Any]]]:
        return chat_messages(example.prompt, system_prompt)

    return episode if cfg.task.env else (lambda example: None)


def prompt_item(group_id: str, index: int, tokens: np.ndarray, example: Example,
                conversation: Optional[Conversation] = None) -> m.PromptItem:
    """One prompt as leased: its tokens, what the rewards are called with, and an episode's conversation."""
    messages = conversation(example) if conversation is not None else None
    return m.PromptItem(group_id=group_id, prompt_index=index, prompt_tokens=m.Tensor.from_numpy(tokens),
                        fields=reward_kwargs(example), prompt_text=prompt_text(example.prompt),
                        messages=messages)
