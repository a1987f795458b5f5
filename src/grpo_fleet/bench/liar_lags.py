"""How often the logprob check catches an actor whose weights are 1 or 2 versions behind the version it claims.

Such a proxy (one that lifts the claimed version, or serves stale weights) is
only a few hundredths of a nat per token off on the demo model. In one process,
the demo task trains on-policy; at each probe version v, submissions of
`max_groups_per_lease` groups are sampled from the weights of v - lag and
claimed as v, in float32 (a CPU actor) and in bfloat16 (a Mac's), then checked
the way the learner checks them (`LogprobCheck` under the weights of v):

- before: the first informative group of a submission against 0.05 nats;
- after: up to security.logprob_checks_per_submission groups, picked at random,
  against the bound for the pair of dtypes (learner/step/gap_bounds.py).

A submission is caught when a checked group is over its bound. Lag 0 is the
honest actor: anything caught there is a false rejection.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map, tree_unflatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop, batched_rollout, demo_run_config
from grpo_fleet.config import SecurityConfig
from grpo_fleet.learner.door.actor_checks import LogprobCheck, WeightHistory
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.learner.step.gap_bounds import logprob_gap_bound
from grpo_fleet.model import load_policy
from grpo_fleet.tasks import build_task

OLD_BOUND = 0.05  # the one-size security.max_logprob_gap before the bound followed the dtypes
LAGS = (0, 1, 2)
DTYPES = ("float32", "bfloat16")


def submission_gaps(loop: TrainLoop, check: LogprobCheck, sampler: Any, version: int, size: int) -> list[float]:
    """The mean per-token gap of each group of one submission sampled by `sampler` and claimed as `version`."""
    groups: list[AcceptedGroup] = loop.batch(sampler, batched_rollout)[:size]
    gaps = []
    for group in groups:
        group.policy_version = version
        gap = check.gap(group)
        assert gap is not None
        gaps.append(gap.mean)
    return gaps


def cast(flat: list[tuple[str, mx.array]], dtype: str) -> Any:
    """Kept weights as the tree an actor sampling in `dtype` loads."""
    target = getattr(mx, dtype)
    return tree_map(lambda w: w.astype(target), tree_unflatten(flat))


def caught(gaps: list[float], checks: int, bound: float, picker: random.Random) -> bool:
    return any(gap > bound for gap in picker.sample(gaps, min(checks, len(gaps))))


def run(report: Report, scale: Scale) -> None:
    warmup, probes, per_probe = (40, 3, 3) if scale is Scale.QUICK else (100, 6, 5)
    checks = SecurityConfig().logprob_checks_per_submission
    picker = random.Random(0)
    gaps: dict[tuple[str, int], list[list[float]]] = {(d, lag): [] for d in DTYPES for lag in LAGS}
    with tempfile.TemporaryDirectory(prefix="grpo-bench-liars-") as tmp:
        cfg = demo_run_config(Path(tmp), warmup + probes, seed=0)
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        loop = TrainLoop.build(cfg, model_path)
        size = cfg.server.max_groups_per_lease
        model = loop.policy.model
        history = WeightHistory(model, keep=max(LAGS))
        check = LogprobCheck(model, history, temperature=cfg.generation.temperature,
                             chunk_tokens=cfg.train.logprob_chunk_tokens,
                             micro_batch_tokens=cfg.train.micro_batch_tokens)
        samplers = {dtype: load_policy(model_path, dtype=dtype) for dtype in DTYPES}
        for version in range(1, warmup + probes + 1):
            loop.train(loop.batch(loop.policy, batched_rollout))
            history.record(version)
            if version <= warmup:
                continue
            for dtype, sampler in samplers.items():
                for lag in LAGS:
                    sampler.model.update(cast(history.versions[version - lag], dtype))
                    for _ in range(per_probe):
                        gaps[(dtype, lag)].append(submission_gaps(loop, check, sampler, version, size))
            print(f"liar_lags v{version}: mean gap by (dtype, lag)",
                  {k: round(float(np.mean([np.mean(s) for s in v])), 4) for k, v in gaps.items()}, flush=True)
    _report(report, gaps, checks, picker, size)


def _report(report: Report, gaps: dict[tuple[str, int], list[list[float]]], checks: int, picker: random.Random,
            size: int) -> None:
    for (dtype, lag), submissions in gaps.items():
        bound = logprob_gap_bound(dtype, "float32")
        after = np.mean([caught(s, checks, bound, picker) for s in submissions])
        before = np.mean([s[0] > OLD_BOUND for s in submissions])
        flat = [g for s in submissions for g in s]
        what = "false rejections of honest actors" if lag == 0 else f"weights {lag} versions stale caught"
        report.add(Figure(
            "liar_lags", f"{dtype} actor, lag {lag}: share of submissions {what}", float(after), "fraction",
            baseline=float(before), baseline_name="first group vs 0.05",
            goal="0" if lag == 0 else ">= 0.95",
            notes=f"{len(submissions)} submissions of {size} groups; per-group mean gap {np.mean(flat):.4f} "
                  f"(min {np.min(flat):.4f}, max {np.max(flat):.4f}) nats; bound {bound}; {checks} checks each",
        ))
