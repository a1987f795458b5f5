"""An exponential moving average: how the learner follows each actor's speed and its own step interval."""

from __future__ import annotations

from dataclasses import dataclass
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
