"""How far an honest actor's logprobs may be from the learner's: a bound that follows both dtypes.

The logprob check (learner/door/verification.py) refuses a group whose mean per-token
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
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Mean per-token gap (nats) an honest group stays under, by the least precise dtype of the pair.
FLOAT32_PAIR_BOUND = 0.001
HALF_PRECISION_BOUND = 0.15
EXACT_DTYPES = frozenset({"float32", "float64"})


def actor_dtype(requested: Optional[str], backend: str) -> Optional[str]:
    """The dtype an actor samples in: what the learner's Welcome asks for (model.dtype), else its default.

    Without a requested dtype an actor casts to float32 on the CPU backend and
    keeps the checkpoint's own dtype on a GPU (model.default_dtype), which the
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
