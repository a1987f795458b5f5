"""Coupled against decoupled on the real model, at the demo fleet's natural staleness and at lag 4.

`bench/offpolicy.py`'s lagged loop (each batch sampled under the weights of
`lag` updates back, trained by `Trainer.step`) on SmolLM2-135M-Instruct with
the real-model task (`bench/real_task.py`: the demo-real config, or the
addition stand-in), LoRA as that config says. The model is loaded once; each
run restores the starting adapters and gets a fresh optimizer, and both
objectives at a seed draw the same sampling stream. Reported per lag: median
held-out reward (greedy) after the fixed step budget over the seeds, and per
staleness actually trained at (a lag-k run's first k steps are fresher): the
off-policy gap |log pi_prox - log pi_behav| (mean, max), the clip fraction and
the cap fraction.

NATURAL_LAG is what the demo's fleet sees: two actors keep `in_flight_steps`
batches out, and with the real model the learner waits on generation, so a
group trains about one version after the one that sampled it (the tiny demo,
whose learner is the slower side, averages about 2: docs/learner-step.md).
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop
from grpo_fleet.bench.offpolicy import OffPolicyStats, lagged_training
from grpo_fleet.bench.real_task import real_config, real_model_dir, real_task_config
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.models.loading import Policy, load_policy

NATURAL_LAG = 1
LAGS = (NATURAL_LAG, 4)
OBJECTIVES = ("coupled", "decoupled")
# 12 runs (3 seeds x 2 lags x 2 objectives), each a held-out round before and after: with the demo's
# B = 4 one run took 15 minutes on the 2-core VM (under load), so the runs train half its batch for 6 steps.
STEPS, SEEDS = 6, (0, 1, 2)
GROUPS_PER_STEP = 2


@dataclass
class RealRun:
    """One (objective, lag, seed) run: held-out reward after the budget, and each step's staleness and stats."""

    objective: str
    lag: int
    seed: int
    final: float
    steps: list[tuple[int, StepStats]]  # (staleness it trained at, what the step saw)


def staleness_of(step: int, lag: int) -> int:
    """Versions between sampler and learner at 1-based `step`: the first steps have no older weights yet."""
    return min(step - 1, lag)


def by_staleness(runs: Sequence[RealRun], objective: str) -> dict[int, OffPolicyStats]:
    """`objective`'s steps of every run pooled by the staleness they trained at."""
    pooled: dict[int, list[StepStats]] = defaultdict(list)
    for run in runs:
        if run.objective == objective:
            for staleness, stats in run.steps:
                pooled[staleness].append(stats)
    return {staleness: OffPolicyStats.of(steps) for staleness, steps in sorted(pooled.items())}


def _with(cfg: RunConfig, objective: str, seed: int) -> RunConfig:
    return cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"objective": objective}),
                                  "train": cfg.train.model_copy(update={"seed": seed})})


def one_run(cfg: RunConfig, policy: Policy, start: list[Any], lag: int) -> RealRun:
    """Train `policy` from the adapters `start` with a fresh optimizer; held-out reward at the end only."""
    policy.model.update(tree_unflatten(list(start)))
    mx.random.seed(cfg.train.seed)  # the same sampling stream for both objectives at a seed
    def progress(step: int, stats: StepStats) -> None:
        print(f"offpolicy_real {cfg.grpo.objective} lag {lag} seed {cfg.train.seed} step {step}: (staleness, gap mean, "
              f"gap max, clip, capped, s) {_row(staleness_of(step, lag), stats)}", flush=True)

    points, steps = lagged_training(TrainLoop.around(cfg, policy), lag, eval_every=cfg.train.steps, on_step=progress)
    return RealRun(cfg.grpo.objective, lag, cfg.train.seed, points[-1][2],
                   [(staleness_of(i, lag), s) for i, s in enumerate(steps, start=1)])


def compare(model_dir: str, config_path: Optional[str], *, steps: int, seeds: Sequence[int],
            lags: Sequence[int]) -> tuple[float, list[RealRun]]:
    """Held-out reward before training, and every (seed, lag, objective) run."""
    runs: list[RealRun] = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-offreal-") as tmp:
        base = real_config(Path(tmp), model_dir=model_dir, seed=seeds[0], steps=steps, config_path=config_path,
                           overrides=[f"grpo.groups_per_step={GROUPS_PER_STEP}"])
        policy = load_policy(model_dir, lora=base.lora if base.lora.enabled else None, dtype=base.model.dtype)
        start: Any = tree_flatten(policy.model.trainable_parameters())
        before = TrainLoop.around(base, policy).held_out()
        print(f"offpolicy_real: held-out reward before training {before:.3f}", flush=True)
        for seed in seeds:
            for lag in lags:
                for objective in OBJECTIVES:
                    run = one_run(_with(base, objective, seed), policy, start, lag)
                    runs.append(run)
                    print(f"offpolicy_real {objective} lag {lag} seed {seed}: held-out {run.final:.3f}", flush=True)
    return before, runs


def _row(staleness: int, stats: StepStats) -> tuple:
    clipped = None if stats.clip_fraction is None else round(stats.clip_fraction, 4)  # None: the loss computes none
    return (staleness, round(stats.offpolicy_gap_mean, 4), round(stats.offpolicy_gap_max, 3),
            clipped, round(stats.is_capped_fraction, 4), round(stats.train_seconds, 1))


def run(report: Report, scale: Scale) -> None:
    quick = scale is Scale.QUICK
    seeds = SEEDS[:1] if quick else SEEDS
    config_path = real_task_config()
    before, runs = compare(real_model_dir(), config_path, steps=STEPS, seeds=seeds, lags=LAGS)
    _report(report, before, runs, config_path or "addition stand-in")


def _report(report: Report, before: float, runs: list[RealRun], task: str) -> None:
    steps = max(len(r.steps) for r in runs)
    for lag in sorted({r.lag for r in runs}):
        finals = {o: [r.final for r in runs if r.objective == o and r.lag == lag] for o in OBJECTIVES}
        report.add(Figure(
            "offpolicy_real", f"real model: held-out reward after {steps} steps at lag {lag}, decoupled vs coupled",
            statistics.median(finals["decoupled"]), "reward", baseline=statistics.median(finals["coupled"]),
            baseline_name="coupled reward",
            notes=f"{task}, {GROUPS_PER_STEP} groups a step; median of seeds {sorted({r.seed for r in runs})}; "
                  f"decoupled {finals['decoupled']}, coupled {finals['coupled']}; before training {before:.3f}",
        ))
    coupled, decoupled = by_staleness(runs, "coupled"), by_staleness(runs, "decoupled")
    for staleness, stats in decoupled.items():
        other = coupled.get(staleness)
        report.add(Figure(
            "offpolicy_real", f"real model: mean |log pi_prox - log pi_behav| at staleness {staleness}",
            stats.gap_mean, "nats",
            notes=f"max {stats.gap_max:.3g} nats (decoupled runs; coupled {_gap(other)}); cap fraction decoupled "
                  f"{stats.capped_fraction:.4f}; clip fraction coupled {_clip(other)}, decoupled {stats.clip_fraction:.4f}",
        ))


def _gap(stats: Optional[OffPolicyStats]) -> str:
    return "-" if stats is None else f"mean {stats.gap_mean:.3g}, max {stats.gap_max:.3g}"


def _clip(stats: Optional[OffPolicyStats]) -> str:
    return "-" if stats is None else f"{stats.clip_fraction:.4f}"
