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
from pathlib import Path

import numpy as np

from grpo_fleet.actor.rollout import SamplingSettings, generate_groups
from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.setup import resolve_model_path
from grpo_fleet.learner.verification import LogprobCheck, WeightHistory
from grpo_fleet.model import load_policy
from grpo_fleet.realshape import build_realshape
from grpo_fleet.tasks import build_task


def gaps(model_path: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(mean, max) per-token gap between sampling in `dtype` and the learner's float32 recomputation."""
    actor = load_policy(model_path, dtype=dtype)
    learner = load_policy(model_path, dtype="float32")
    settings = SamplingSettings(group_size=4, max_tokens=max_tokens, temperature=1.0,
                                stop_token_ids=sorted(actor.tokenizer.eos_token_ids))
    history = WeightHistory(learner.model, keep=1)
    history.record(0)
    check = LogprobCheck(learner.model, history, temperature=1.0, chunk_tokens=256, micro_batch_tokens=4096, max_gap=1.0)
    means, maxes = [], []
    for index, (prompt, group) in enumerate(zip(prompts, generate_groups(actor.model, prompts, settings))):
        records = [CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32), float(i),
                                    c.finish_reason) for i, c in enumerate(group)]
        gap = check.gap(AcceptedGroup(f"g{index}", index, np.asarray(prompt, np.int32), records, 0, "bench"))
        assert gap is not None
        means.append(gap.mean)
        maxes.append(gap.max)
    return float(np.mean(means)), float(np.max(maxes))


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
                                  mean, "nats", goal="< its bound (learner/gap_bounds.py)",
                                  notes=f"largest single-token gap {worst:.4f} nats; G=4 x {len(prompts)} prompts"))
