"""Completion lengths: how many tokens each simulated completion runs to, drawn from a named distribution.

At reasoning lengths (hundreds of tokens, 10x apart within one group) the
spread is what moves a fleet's costs: a batch waits for its longest row, the
learner pads to the longest, and long leases come back more versions behind.
`decoding` turns drawn lengths into an actor's seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

Kind = Literal["fixed", "uniform", "lognormal"]
KINDS: tuple[Kind, ...] = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthSpec:
    """How many tokens a completion runs to, drawn per completion and clipped to [low, high].

    - `fixed`: every completion is `high` tokens (the simulator's old model).
    - `uniform`: an integer drawn evenly from [low, high].
    - `lognormal`: `median x exp(sigma x z)` with z standard normal, rounded and
      clipped to [low, high]. Reasoning lengths are skewed this way: most near a
      median, a long tail, and the tail cut off at `max_tokens` (`high`). With
      sigma 0.6 the middle 95% spans 10x.
    """

    kind: Kind = "fixed"
    high: int = 384  # generation.max_tokens: no completion runs longer
    low: int = 1  # the shortest completion (uniform's and lognormal's lower clip)
    median: float = 0.0  # lognormal only
    sigma: float = 0.0  # lognormal only: the spread of log(length)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a length distribution is one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths need 1 <= low <= high, got {self.low} and {self.high}")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError("a lognormal length needs median > 0 and sigma >= 0")

    def sample(self, draw: random.Random, count: int) -> list[int]:
        """`count` lengths, from the caller's seeded `draw` (so a simulation repeats)."""
        if self.kind == "fixed":
            return [self.high] * count
        if self.kind == "uniform":
            return [draw.randint(self.low, self.high) for _ in range(count)]
        return [self._clip(round(self.median * math.exp(self.sigma * draw.gauss(0.0, 1.0)))) for _ in range(count)]

    def mean(self, draws: int = 20_000) -> float:
        """The mean length, estimated from a fixed-seed draw (exact for `fixed`)."""
        return sum(self.sample(random.Random(0), draws)) / draws if self.kind != "fixed" else float(self.high)

    def _clip(self, tokens: int) -> int:
        return min(self.high, max(self.low, tokens))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"every completion {self.high} tokens"
        if self.kind == "uniform":
            return f"lengths uniform in {self.low}..{self.high} tokens"
        return f"lengths lognormal (median {self.median:g}, sigma {self.sigma:g}) clipped to {self.low}..{self.high}"


def parse_lengths(text: str, high: int) -> LengthSpec:
    """`fixed`, `uniform:LOW` or `lognormal:MEDIAN:SIGMA[:LOW]`, clipped at `high` (the run's max_tokens)."""
    kind, *args = text.split(":")
    try:
        if kind == "fixed" and not args:
            return LengthSpec("fixed", high)
        if kind == "uniform" and len(args) == 1:
            return LengthSpec("uniform", high, low=int(args[0]))
        if kind == "lognormal" and len(args) in (2, 3):
            low = int(args[2]) if len(args) == 3 else 1
            return LengthSpec("lognormal", high, low=low, median=float(args[0]), sigma=float(args[1]))
    except ValueError as exc:
        raise ValueError(f"bad length distribution {text!r}: {exc}") from exc
    raise ValueError(f"bad length distribution {text!r}: use fixed, uniform:LOW or lognormal:MEDIAN:SIGMA[:LOW]")
