"""What the learner knows about its actors: identity, liveness, throughput, metrics address.

Plain bookkeeping (no sockets). It feeds leases (who owns what), Prometheus
service discovery (`/sd`) and `grpo-fleet status`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from grpo_fleet.learner.pacing import MovingAverage
from grpo_fleet.protocol import messages as m

# Throughput is averaged over this window, so `status` shows current speed, not lifetime speed.
RATE_WINDOW_SECONDS = 60.0


@dataclass
class TokenRate:
    """Tokens per second over the last RATE_WINDOW_SECONDS."""

    events: deque = field(default_factory=deque)

    def add(self, tokens: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.events.append((now, tokens))
        # Pruned here too, not only when `status` asks: without it a run nobody
        # watches keeps one event per accepted group for its whole life.
        self._forget_before(now - RATE_WINDOW_SECONDS)

    def _forget_before(self, cutoff: float) -> None:
        while self.events and self.events[0][0] < cutoff:
            self.events.popleft()

    def per_second(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        self._forget_before(now - RATE_WINDOW_SECONDS)
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1.0)
        return sum(tokens for _, tokens in self.events) / span


@dataclass
class ActorInfo:
    """A registered actor."""

    actor_id: str
    host: str
    backend: str
    principal: str  # the CURVE public key when CURVE is on, else the routing id in hex
    last_seen: float
    metrics_target: Optional[str] = None  # "address:port" Prometheus can scrape
    policy_version: int = 0
    rate: TokenRate = field(default_factory=TokenRate)
    # Measured from returned leases; sizes its next leases (learner/pacing.py).
    groups_per_second: MovingAverage = field(default_factory=MovingAverage)
    last_return: Optional[float] = None  # scheduler clock, when its last lease came back

    def status(self, now: float) -> m.ActorStatus:
        return m.ActorStatus(
            actor_id=self.actor_id, host=self.host, backend=self.backend, policy_version=self.policy_version,
            tokens_per_second=self.rate.per_second(now), last_seen_seconds=max(0.0, now - self.last_seen),
            groups_per_second=self.groups_per_second.value,
        )


def actor_from_hello(hello: m.Hello, principal: str, peer_address: str) -> ActorInfo:
    """Register what an actor says about itself; its scrape address is where it connected from."""
    target = f"{_url_host(peer_address)}:{hello.metrics_port}" if hello.metrics_port and peer_address else None
    return ActorInfo(
        actor_id=hello.actor_id, host=hello.host, backend=hello.backend, principal=principal,
        last_seen=time.monotonic(), metrics_target=target,
    )


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def sd_groups(learner_target: Optional[str], actors: list[ActorInfo]) -> list[dict]:
    """The JSON Prometheus `http_sd_configs` reads: the learner and every live actor."""
    groups = []
    if learner_target:
        groups.append({"targets": [learner_target], "labels": {"role": "learner"}})
    for actor in actors:
        if actor.metrics_target:
            groups.append({"targets": [actor.metrics_target], "labels": {"role": "actor", "actor": actor.actor_id}})
    return groups
