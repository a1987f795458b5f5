"""How far an honest actor's logprobs are from the learner's: the noise floor under security.max_logprob_gap.

Completions are sampled by the actor's own path (`generate_groups`, float32
logits divided by T) with the model in float32 and in bfloat16 (what a Mac
actor runs), then recomputed by the learner's check (`LogprobCheck`, float32,
chunked head) under the same weights. Measured on the tiny demo model and on
Qwen2.5-0.5B's real shape (2 of its 24 blocks, the 151,936-token vocabulary,
whose large logits are where bf16 rounding shows). Metal's bf16 kernels round
like the CPU's bf16 here up to summation order; no Metal machine measured this.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, LogprobGap, WeightHistory
from grpo_fleet.models.generation import SamplingSettings, generate_groups
from grpo_fleet.models.loading import Policy, load_policy
from grpo_fleet.models.realshape import build_realshape
from grpo_fleet.tasks import build_task


def group_gaps(model_path: str, dtype: str, prompts: Sequence[Sequence[int]], max_tokens: int, *,
               group_size: int = 4, temperature: float = 1.0, chunk_tokens: int = 256,
               learner: Optional[Policy] = None) -> list[LogprobGap]:
    """Each group's gap between sampling in `dtype` (the actor's path) and the learner's float32 `LogprobCheck`.

    `learner`: the float32 policy that checks, if already loaded (else loaded here).
    """
    actor = load_policy(model_path, dtype=dtype)
    learner = learner or load_policy(model_path, dtype="float32")
    settings = SamplingSettings(group_size=group_size, max_tokens=max_tokens, temperature=temperature,
                                stop_token_ids=sorted(actor.tokenizer.eos_token_ids))
    history = WeightHistory(learner.model, keep=1)
    history.record(0)
    check = LogprobCheck(learner.model, history, temperature=temperature, chunk_tokens=chunk_tokens,
                         micro_batch_tokens=4096, max_gap=1.0)
    found = []
    for index, (prompt, group) in enumerate(zip(prompts, generate_groups(actor.model, prompts, settings))):
        records = [CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32), float(i),
                                    c.finish_reason) for i, c in enumerate(group)]
        gap = check.gap(AcceptedGroup(f"g{index}", index, np.asarray(prompt, np.int32), records, 0, "bench"))
        assert gap is not None
        found.append(gap)
    return found


def gaps(model_path: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(mean, max) per-token gap between sampling in `dtype` and the learner's float32 recomputation."""
    found = group_gaps(model_path, dtype, prompts, max_tokens)
    return float(np.mean([g.mean for g in found])), float(np.max([g.max for g in found]))


def run(report: Report, scale: Scale) -> None:
    quick = scale is Scale.QUICK
    with tempfile.TemporaryDirectory(prefix="grpo-bench-gap-") as tmp:
        cfg = RunConfig.model_validate({"run_dir": str(Path(tmp) / "run"), "model": {"path": "tiny"}})
        tiny = resolve_model_path(cfg, build_task(cfg.task))
        real = str(build_realshape("realshape:qwen2.5-0.5b?layers=2"))
        for name, path, prompts, tokens in (("tiny demo model", tiny, [[5, 6, 7, 8]] * 8, 5),
                                            ("Qwen2.5-0.5B shape, 2 blocks", real, [[100 + i, 2000, 300] for i in range(4)],
                                             32 if quick else 64)):
            for dtype in ("float32", "bfloat16"):
                mean, worst = gaps(path, dtype, prompts, tokens)
                report.add(Figure("logprob_gap", f"{name}: {dtype} actor vs float32 learner, mean per-token gap",
                                  mean, "nats", goal="< its bound (learner/step/gap_bounds.py)",
                                  notes=f"largest single-token gap {worst:.4f} nats; G=4 x {len(prompts)} prompts"))
