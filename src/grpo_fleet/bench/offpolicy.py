"""Off-policy learning: the coupled and the decoupled objective with actors kept `lag` updates behind.

A fleet's groups arrive several policy versions stale. To compare objectives at
a controlled staleness, this runs the demo task in one process: each step's
groups are sampled from a copy of the policy as it was `lag` updates ago (the
sampler's weights are the learner's from `lag` steps back, exactly as an actor
that pulls weights late), then trained by `Trainer.step`. Lag 0 is on-policy.
Each (objective, lag) runs `seeds` times; held-out reward (greedy, the demo's
128 prompts) is measured every EVAL_EVERY steps. Reported: median steps and
seconds to the target held-out reward, and median held-out reward after the
step budget, decoupled against coupled.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop, batched_rollout, demo_run_config
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.tasks import build_task

EVAL_EVERY = 100
TARGET = 0.4  # held-out reward: on-policy, the in-process loop passes it around step 500


@dataclass(frozen=True)
class OffPolicyStats:
    """What the trainer saw of staleness over a run: means over its steps, and the largest single-token gap."""

    gap_mean: float  # |log pi_prox - log pi_behav| over each step's tokens, averaged over steps
    gap_max: float
    clip_fraction: float
    capped_fraction: float  # tokens whose behaviour weight the cap truncated or masked (0 under coupled)

    @classmethod
    def of(cls, steps: Sequence[StepStats]) -> "OffPolicyStats":
        if not steps:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        clipped = [float("nan") if s.clip_fraction is None else s.clip_fraction for s in steps]  # none: no such stat
        return cls(statistics.fmean(s.offpolicy_gap_mean for s in steps), max(s.offpolicy_gap_max for s in steps),
                   statistics.fmean(clipped), statistics.fmean(s.is_capped_fraction for s in steps))


@dataclass
class Run:
    objective: str
    lag: int
    seed: int
    points: list[tuple[int, float, float]]  # (step, training seconds, held-out reward)
    offpolicy: Optional[OffPolicyStats] = None

    def steps_to(self, target: float) -> Optional[int]:
        return next((step for step, _, reward in self.points if reward >= target), None)

    def seconds_to(self, target: float) -> Optional[float]:
        return next((seconds for _, seconds, reward in self.points if reward >= target), None)

    @property
    def final(self) -> float:
        return self.points[-1][2]


def lagged_run(cfg: RunConfig, model_path: str, lag: int) -> list[tuple[int, float, float]]:
    """Train for cfg.train.steps, sampling each batch from the weights of `lag` updates ago."""
    # The same sampling stream for both objectives at a seed: at lag 0 their losses are the same, so what
    # differs between them is the objective, not which completions happened to be drawn.
    mx.random.seed(cfg.train.seed)
    points, _ = lagged_training(TrainLoop.build(cfg, model_path), lag, EVAL_EVERY)
    return points


def lagged_training(
    loop: TrainLoop, lag: int, eval_every: int, on_step: Optional[Callable[[int, StepStats], None]] = None,
    on_batch: Optional[Callable[[list[AcceptedGroup]], None]] = None,
) -> tuple[list[tuple[int, float, float]], list[StepStats]]:
    """Train `loop` for its cfg.train.steps, each batch sampled under the weights of `lag` updates back.

    The sampler is the policy itself with the old trainable weights swapped in
    for the rollout, as an actor that pulls weights late, then swapped back; kept
    versions are references to immutable arrays (nothing extra under LoRA).
    Held-out reward every `eval_every` steps, with the training clock stopped;
    `on_step(step, stats)` after each step (progress for long runs); `on_batch(groups)`
    with each batch before it trains (its replies' lengths, a probe for the KL).
    """
    model = loop.policy.model
    history: deque[Any] = deque([tree_flatten(model.trainable_parameters())], maxlen=lag + 1)
    points, steps, trained_seconds = [], [], 0.0
    for step in range(1, loop.cfg.train.steps + 1):
        started = time.perf_counter()
        live = history[-1]
        model.update(tree_unflatten(list(history[0])))  # the oldest kept: `lag` updates back
        try:
            batch = loop.batch(loop.policy, batched_rollout)
        finally:
            model.update(tree_unflatten(list(live)))
        if on_batch is not None:
            on_batch(batch)
        steps.append(loop.train(batch))
        if on_step is not None:
            on_step(step, steps[-1])
        history.append(tree_flatten(model.trainable_parameters()))
        trained_seconds += time.perf_counter() - started
        if step % eval_every == 0:
            points.append((step, trained_seconds, loop.held_out()))
    return points, steps


def _median(values: list[Optional[float]]) -> Optional[float]:
    """The median, or None unless every run reached the target."""
    return statistics.median([v for v in values if v is not None]) if values and None not in values else None


def run(report: Report, scale: Scale) -> None:
    steps, seeds, lags = (300, (0,), (0, 4)) if scale is Scale.QUICK else (600, (0, 1, 2), (0, 4))
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-offpolicy-") as tmp:
        for seed in seeds:
            base = demo_run_config(Path(tmp) / f"seed{seed}", steps, seed)
            model_path = resolve_model_path(base, build_task(base.task))
            for lag in lags:
                for objective in ("coupled", "decoupled"):
                    cfg = base.model_copy(update={"grpo": base.grpo.model_copy(update={"objective": objective})})
                    points = lagged_run(cfg, model_path, lag)
                    runs.append(Run(objective, lag, seed, points))
                    print(f"offpolicy {objective} lag {lag} seed {seed} (step, s, reward):",
                          [(s, round(t, 1), round(r, 3)) for s, t, r in points], flush=True)
    _report(report, runs, lags, steps)


def _report(report: Report, runs: list[Run], lags: tuple[int, ...], steps: int) -> None:
    def pick(objective: str, lag: int) -> list[Run]:
        return [r for r in runs if r.objective == objective and r.lag == lag]

    for lag in lags:
        coupled, decoupled = pick("coupled", lag), pick("decoupled", lag)
        notes = (f"sampler {lag} updates behind; median of {len(coupled)} seeds; target {TARGET}; steps to target "
                 f"coupled {[r.steps_to(TARGET) for r in coupled]}, decoupled {[r.steps_to(TARGET) for r in decoupled]}")
        if lag > 0:
            report.add(Figure(
                "offpolicy", f"steps to held-out {TARGET} at staleness {lag}, decoupled vs coupled",
                _median([r.steps_to(TARGET) for r in decoupled]) or float("nan"), "steps",
                baseline=_median([r.steps_to(TARGET) for r in coupled]), baseline_name="coupled steps",
                goal="<= 0.8x", notes=notes,
            ))
            report.add(Figure(
                "offpolicy", f"training seconds to held-out {TARGET} at staleness {lag}, decoupled vs coupled",
                _median([r.seconds_to(TARGET) for r in decoupled]) or float("nan"), "s",
                baseline=_median([r.seconds_to(TARGET) for r in coupled]), baseline_name="coupled s", notes=notes,
            ))
        report.add(Figure(
            "offpolicy", f"held-out reward after {steps} steps at staleness {lag}, decoupled vs coupled",
            statistics.median(r.final for r in decoupled), "reward",
            baseline=statistics.median(r.final for r in coupled), baseline_name="coupled reward",
            goal="within 5% (0.95-1.05x)" if lag == 0 else "", notes=notes,
        ))
