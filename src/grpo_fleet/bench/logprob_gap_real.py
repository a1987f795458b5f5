"""Verification on real text: honest actors' logprob gaps on the real model, against the logprob check's bound.

The real-model task's prompts (`bench/real_task.py`, chat template as its config
says) are sampled by the actor's path (`generate_groups`) with SmolLM2-135M in
float32 and in bfloat16 (a Mac actor), and every group is re-scored by the
learner's check (`LogprobCheck`: float32, chunked head, `forward.frozen_logprobs`)
at version 0, as the learner checks the first informative group of each lease.
Reported per actor dtype: the distribution of the per-group mean gap (the number
the check compares with its bound: security.max_logprob_gap, else gap_bounds.py's
for the pair of dtypes), the largest single-token gap, and how many honest groups
the check would have refused (goal: none).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.logprob_gap import group_gaps
from grpo_fleet.bench.real_task import real_config, real_model_dir, real_task_config
from grpo_fleet.learner.run.build import tokenize_prompts
from grpo_fleet.learner.step.gap_bounds import logprob_gap_bound
from grpo_fleet.learner.verify.actor_checks import LogprobGap
from grpo_fleet.models.loading import load_policy
from grpo_fleet.tasks import build_task

PROMPTS = 16  # groups per actor dtype
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class GapDistribution:
    """Per-group mean gaps of honest groups, summarised, and how many a bound would refuse."""

    groups: int
    mean: float
    p50: float
    p99: float
    max: float
    token_max: float  # the largest single-token gap of any group
    rejected: int  # groups whose mean gap is beyond the bound: false rejections, all of them honest

    @classmethod
    def of(cls, gaps: Sequence[LogprobGap], bound: float) -> "GapDistribution":
        means = np.array([g.mean for g in gaps], dtype=np.float64)
        return cls(len(gaps), float(means.mean()), float(np.percentile(means, 50)), float(np.percentile(means, 99)),
                   float(means.max()), max(g.max for g in gaps), int((means > bound).sum()))


def run(report: Report, scale: Scale) -> None:
    quick = scale is Scale.QUICK
    count = PROMPTS // 2 if quick else PROMPTS
    model_dir = real_model_dir()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-gapreal-") as tmp:
        cfg = real_config(Path(tmp), model_dir=model_dir, seed=0, steps=1, config_path=real_task_config())
        learner = load_policy(model_dir, dtype="float32")
        prompts = [p.tolist() for p in tokenize_prompts(learner.tokenizer, build_task(cfg.task), cfg)[:count]]
    gen = cfg.generation
    for dtype in DTYPES:
        # The learner's bound for this pair of dtypes (learner/step/gap_bounds.py), unless the config sets one.
        bound = cfg.security.max_logprob_gap or logprob_gap_bound(dtype, "float32")
        found = group_gaps(model_dir, dtype, prompts, gen.max_tokens, group_size=gen.group_size,
                           temperature=gen.temperature, chunk_tokens=cfg.train.logprob_chunk_tokens, learner=learner)
        dist = GapDistribution.of(found, bound)
        print(f"logprob_gap_real {dtype}: per-group mean gaps {[round(g.mean, 6) for g in found]}", flush=True)
        report.add(Figure(
            "logprob_gap_real", f"real model: {dtype} actor vs float32 learner, honest groups refused",
            dist.rejected, "groups", goal="0", notes=f"of {dist.groups} groups (G={gen.group_size}, up to "
            f"{gen.max_tokens} tokens) at the check's bound {bound} nats",
        ))
        report.add(Figure(
            "logprob_gap_real", f"real model: {dtype} actor vs float32 learner, p99 of per-group mean gap",
            dist.p99, "nats", goal=f"< the check's bound {bound}",
            notes=f"mean {dist.mean:.3g}, p50 {dist.p50:.3g}, max {dist.max:.3g}; largest single-token gap "
                  f"{dist.token_max:.3g} nats",
        ))
