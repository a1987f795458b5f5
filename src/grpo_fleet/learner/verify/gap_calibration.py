"""The honest logprob gap of this run's model, measured at start: the bound the check holds half-precision actors to.

One constant per dtype pair (learner/step/gap_bounds.py) had to cover every model,
so it sat above the noise of the noisiest (SmolLM2-135M in bfloat16: 0.045 nats a
token) and let a bfloat16 actor serving weights a version stale through on every
other model (the tiny demo model's honest floor is 0.0015, such a liar's 0.01).
So the learner samples a few groups of its own, as an actor would (the actor's
sampling path, the model cast to the actor's dtype), recomputes them as the check
does, and keeps a margin over what it saw (`gap_bounds.calibrated_bound`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.gap_bounds import (
    FLOAT32_PAIR_BOUND,
    CalibratedBounds,
    GapBound,
    actor_dtype,
    calibrated_bound,
    default_bound,
)
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, WeightHistory
from grpo_fleet.models.generation import SamplingSettings, generate_groups

log = logging.getLogger("grpo_fleet.learner")


@dataclass(frozen=True)
class HonestBounds:
    """The honest gaps an actor is held to, by the backend its Hello names (learner/step/gap_bounds.py)."""

    requested_dtype: Optional[str] = None  # model.dtype: what every actor is told to sample in
    learner_dtype: str = "float32"  # what the learner recomputes logprobs in
    # Actor dtype -> the half-precision bound measured on this run's model at start: the pairs, or what gives them
    # once measured (PendingCalibration.bounds).
    calibrated: CalibratedBounds | Callable[[], CalibratedBounds] = ()

    def of(self, backend: str) -> GapBound:
        """An actor on `backend`'s bound. A half-precision pair takes the bound calibrated on this model: for the
        actor's own dtype, else bfloat16's, which rounds coarsest (an actor of unknown dtype is held to it too)."""
        dtype = actor_dtype(self.requested_dtype, backend)
        ceiling = default_bound(dtype, self.learner_dtype)
        if ceiling.mean <= FLOAT32_PAIR_BOUND:
            return ceiling
        measured = dict(self.calibrated() if callable(self.calibrated) else self.calibrated)
        return measured.get(dtype or "bfloat16", measured.get("bfloat16", ceiling))


@dataclass(frozen=True)
class Calibration:
    """The honest gaps seen, and the bound made from them."""

    dtype: str  # the actor dtype sampled in
    group_means: list[float]
    worst_tokens: list[float]
    bound: GapBound
    seconds: float


class PendingCalibration:
    """The calibrated bounds, measured once, by whichever thread asks first; the others wait for them.

    Measuring takes a minute at long answers on a CPU (sampling in bfloat16), and
    nothing needs the bound until a half-precision group arrives, which takes an
    actor at least as long. So the learner admits actors at once, its training
    thread (which owns the model) measures before its first step, and intake, on
    its own thread, waits only if a group comes back first. Where no training
    thread runs (a coordinator driven by hand), the first caller measures.
    A measurement that fails leaves the fixed ceilings, which are looser, not open.
    """

    def __init__(self, measure: Callable[[], CalibratedBounds]) -> None:
        self._measure: Callable[[], CalibratedBounds] | None = measure
        self._claim = threading.Lock()
        self._done = threading.Event()
        self._bounds: CalibratedBounds = ()

    def run(self) -> None:
        """Measure now, unless another thread has already started (then return at once)."""
        with self._claim:
            measure, self._measure = self._measure, None
        if measure is None:
            return
        try:
            self._bounds = measure()
        except Exception:  # the check still runs, against the ceilings
            log.exception("logprob check calibration failed; half-precision actors are held to the fixed ceilings")
        finally:
            self._done.set()

    def abandon(self) -> None:
        """Never measure (the run stops first): waiters get the ceilings instead of waiting for ever."""
        with self._claim:
            unclaimed, self._measure = self._measure is not None, None
        if unclaimed:  # one that is measuring sets it itself, when done
            self._done.set()

    def bounds(self) -> CalibratedBounds:
        """The measured bounds, measuring them here if no thread has started, else waiting for the one that has."""
        self.run()
        self._done.wait()
        return self._bounds


def _cast_floating(model: nn.Module, dtype: str) -> list[tuple[str, mx.array]]:
    """Cast `model`'s floating weights to `dtype` in place; returns what to restore."""
    original: Any = tree_flatten(model.parameters())
    target = getattr(mx, dtype)
    model.update(tree_map(lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    return list(original)


def honest_groups(model: nn.Module, prompts: Sequence[np.ndarray], settings: SamplingSettings,
                  dtype: str) -> list[AcceptedGroup]:
    """Groups sampled by `model` cast to `dtype`, through the actor's own sampling path; the weights are restored."""
    original = _cast_floating(model, dtype)
    try:
        sampled = generate_groups(model, [p.tolist() for p in prompts], settings)
    finally:
        model.update(tree_unflatten(original))
    groups = []
    for index, (prompt, completions) in enumerate(zip(prompts, sampled)):
        records = [CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32), float(i),
                                    c.finish_reason) for i, c in enumerate(completions)]
        groups.append(AcceptedGroup(f"calibration-{index}", index, np.asarray(prompt, np.int32), records, 0, "learner"))
    return groups


def calibrate(model: nn.Module, prompts: Sequence[np.ndarray], settings: SamplingSettings, *, dtype: str,
              ceiling: GapBound, chunk_tokens: int, micro_batch_tokens: int) -> Calibration:
    """The bound for actors sampling in `dtype`, from the gaps of honest groups of this model (training thread)."""
    started = time.perf_counter()
    history = WeightHistory(model, keep=0)
    history.record(0)
    check = LogprobCheck(model, history, temperature=settings.temperature, chunk_tokens=chunk_tokens,
                         micro_batch_tokens=micro_batch_tokens)
    gaps = [gap for gap in check.gaps(honest_groups(model, prompts, settings, dtype)) if gap is not None]
    means, worst = [g.mean for g in gaps], [g.max for g in gaps]
    bound = calibrated_bound(ceiling, means, worst)
    seconds = time.perf_counter() - started
    log.info("logprob check calibrated for %s actors in %.1f s: honest group means up to %.4f nats, worst token %.3f; "
             "bound %.4f mean, %.3f a token", dtype, seconds, max(means, default=0.0), max(worst, default=0.0),
             bound.mean, bound.token)
    return Calibration(dtype, means, worst, bound, seconds)
