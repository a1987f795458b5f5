"""Capacity-based lease sizing: how many groups to hand an actor, from how fast it is.

Pure functions and a small estimator, no sockets and no clock of their own. The
learner measures each actor's groups per second from its returned leases and its
own step interval, and sizes every lease so that it comes back within a target
time. A fast Mac gets big leases, a slow one small leases, so a slow Mac never
holds prompts the step is waiting for, and its groups come back before they are
too stale to use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# Weight of the newest sample in the moving averages: recent enough to follow an
# actor that slows down (thermal throttling, a user on the Mac), smooth enough to
# ignore one slow lease.
EMA_WEIGHT = 0.3
# A lease should come back well before it expires and is re-queued.
DEADLINE_SHARE = 0.5


@dataclass
class MovingAverage:
    """Exponential moving average; `value` is None until the first sample."""

    weight: float = EMA_WEIGHT
    value: Optional[float] = None

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else self.weight * sample + (1 - self.weight) * self.value
        return self.value


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
