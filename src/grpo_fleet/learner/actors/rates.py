"""How the learner measures speed: a moving average (each actor's groups/s, its own step interval) and a
windowed token rate (what `status` shows). Kept apart from the registry, which only holds them per actor.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

# Weight of the newest sample in the moving averages: recent enough to follow an
# actor that slows down (thermal throttling, a user on the Mac), smooth enough to
# ignore one slow lease.
EMA_WEIGHT = 0.3


@dataclass
class MovingAverage:
    """Exponential moving average; `value` is None until the first sample."""

    weight: float = EMA_WEIGHT
    value: Optional[float] = None

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else self.weight * sample + (1 - self.weight) * self.value
        return self.value


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
