"""How far an honest actor's logprobs may be from the learner's: a bound that follows both dtypes.

The logprob check (learner/verify/actor_checks.py) refuses a group whose mean per-token
gap to the learner's recomputation is beyond a bound. One bound for every pair
of dtypes was either loose for float32 actors (whose floor is ~1e-6 nats, so a
proxy serving weights one or two versions stale, 0.02-0.07 nats off on the demo
model, passed under 0.05) or tight enough to ban honest bf16 Macs. So the bound
is taken from the measured floor of the pair (bench/logprob_gap.py, bench/RESULTS.md):

| actor vs learner | mean per-token floor | largest token | bound |
|---|---|---|---|
| float32 vs float32 | 7e-8 (tiny) .. 8e-7 (Qwen2.5 shape) .. 3e-6 (SmolLM2-135M, 30 blocks) | 1.5e-5 | 0.001 |
| bfloat16 vs float32 | 0.001 (tiny) .. 0.0043 (Qwen2.5 shape) .. 0.045 (SmolLM2-135M) | 0.33 | 0.15 |

The float32 bound is 300 times its largest floor and a third of the
smallest stale-weights gap measured (0.0033 nats, bench/liar_lags.py). The
half-precision floor depends on the model: a real pretrained one (SmolLM2-135M,
30 blocks) rounds ten times further than random weights at Qwen's shape, so its
bound is 3.3x the largest mean floor measured. That still catches altered
logprobs (about 1 nat) but not weights a version or two stale (0.01-0.06 nats):
for a bf16 actor only a floor measured on the run's own model could. float16 rounds finer than bfloat16 and gets its bound;
so does a half-precision learner, or an actor whose dtype is not known.
`security.max_logprob_gap` overrides all of this.

**Calibrated per run, per token as well as on the mean.** The table's constants are
ceilings. At start the learner samples a few groups of its own in the actor's dtype
and recomputes them as the check does (learner/door: the gap calibration): the half-
precision bound becomes a margin over the honest gaps of *this* model, between a
floor (Metal rounds in a different order than this CPU) and the ceiling. On the
tiny model that is 0.003-0.007 nats instead of 0.15, so a bfloat16 actor serving
weights one version stale (0.0045-0.03 nats) is caught. The mean alone lets a few
tokens hide a large lie (12 tokens of 1,600 shifted by 20 nats move the mean by
0.15), so every token is judged too, against a margin over the honest worst token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

# Mean per-token gap (nats) an honest group stays under, by the least precise dtype of the pair.
FLOAT32_PAIR_BOUND = 0.001
HALF_PRECISION_BOUND = 0.15
EXACT_DTYPES = frozenset({"float32", "float64"})
# The largest single-token gap an honest completion has, before calibration (SmolLM2-135M's bf16 worst token is 0.33).
FLOAT32_TOKEN_BOUND = 0.05
HALF_PRECISION_TOKEN_BOUND = 1.0
# Calibration: the bound is MARGIN times the honest worst, kept between the floor and the ceiling above. The floor
# allows for the actor's hardware rounding differently from this machine's (a Mac's Metal kernels vs this CPU).
MEAN_MARGIN, TOKEN_MARGIN = 3.0, 4.0
HALF_PRECISION_MEAN_FLOOR, HALF_PRECISION_TOKEN_FLOOR = 0.003, 0.1


@dataclass(frozen=True)
class GapBound:
    """What an honest group stays under: its mean per-token gap, and every single token's gap (nats)."""

    mean: float
    token: float

    def judge(self, mean: float, worst: float) -> Optional[str]:
        """"mean" or "token" when a group's gaps are beyond this bound (the mean first), else None."""
        if mean > self.mean:
            return "mean"
        if worst > self.token:
            return "token"
        return None


CalibratedBounds = tuple[tuple[str, GapBound], ...]  # actor dtype -> the bound measured on this run's model


def default_bound(actor: Optional[str], learner: str) -> GapBound:
    """The uncalibrated bound of a dtype pair: the ceilings of the table above."""
    if actor in EXACT_DTYPES and learner in EXACT_DTYPES:
        return GapBound(FLOAT32_PAIR_BOUND, FLOAT32_TOKEN_BOUND)
    return GapBound(HALF_PRECISION_BOUND, HALF_PRECISION_TOKEN_BOUND)


def calibrated_bound(ceiling: GapBound, honest_means: Sequence[float], honest_worst: Sequence[float]) -> GapBound:
    """A margin over the honest gaps measured on this run's model, between the floor and `ceiling`.

    A float32 pair keeps its ceiling (0.001 already catches a version-stale float32
    actor every time, and a Mac's float32 sums in another order than this CPU).
    """
    if ceiling.mean <= FLOAT32_PAIR_BOUND or not honest_means:
        return ceiling
    mean = min(ceiling.mean, max(HALF_PRECISION_MEAN_FLOOR, MEAN_MARGIN * max(honest_means)))
    token = min(ceiling.token, max(HALF_PRECISION_TOKEN_FLOOR, TOKEN_MARGIN * max(honest_worst)))
    return GapBound(mean, token)


def group_gap(reported: np.ndarray, recomputed: np.ndarray) -> tuple[float, float]:
    """(mean, max) |reported - recomputed| over one group's checked tokens; (0, 0) when it has none."""
    diff = np.abs(np.asarray(reported, np.float64) - np.asarray(recomputed, np.float64))
    return (float(diff.mean()), float(diff.max())) if diff.size else (0.0, 0.0)


def actor_dtype(requested: Optional[str], backend: str) -> Optional[str]:
    """The dtype an actor samples in: what the learner's Welcome asks for (model.dtype), else its default.

    Without a requested dtype an actor casts to float32 on the CPU backend and
    keeps the checkpoint's own dtype on a GPU (models/loading.py: default_dtype), which the
    learner does not know: None. `backend` is what the actor's Hello says
    (str(mx.default_device())); claiming "cpu" falsely only tightens its own bound.
    """
    if requested:
        return requested
    return "float32" if "cpu" in backend.lower() else None


def logprob_gap_bound(actor: Optional[str], learner: str) -> float:
    """The largest mean per-token gap an honest actor sampling in `actor` has from a learner in `learner`."""
    if actor in EXACT_DTYPES and learner in EXACT_DTYPES:
        return FLOAT32_PAIR_BOUND
    return HALF_PRECISION_BOUND


def compute_dtype(model: nn.Module) -> str:
    """The least precise floating dtype among `model`'s parameters ("float32" when it has none)."""
    flat: Any = tree_flatten(model.parameters())
    floating = [v.dtype for _, v in flat if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)]
    if not floating:
        return "float32"
    return str(min(floating, key=lambda dtype: dtype.size)).removeprefix("mlx.core.")
