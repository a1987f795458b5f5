"""Real-model rows, learner side: one `Trainer.step` on a lease of real completions.

The actor's path (`generate_groups`) samples one lease from the real model;
its completions, with their recorded logprobs and spread rewards (so every
group trains), become one batch. One step of the learner's `Trainer` (LoRA r8,
the config's GRPO defaults: beta 0.04, so the pi_ref pass runs) is timed after
a warm-up step on one group. Reported: tokens/s of the step, counting
completion tokens (what the loss trains on) and all tokens (prompt included,
what the model body runs on), and the share of micro-batch positions that are
padding, next to the share in the one padded batch before it is split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.real_decode import REAL_MODEL_ENV, LeaseShape, lease_prompts, real_model_dir
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import MicroBatch, TrainBatch, row_lengths


def padding_share(shapes: Sequence[tuple[int, int]], real_positions: int) -> float:
    """Share of padded positions in arrays of `shapes` ([rows, width] each) that hold `real_positions` real ones."""
    total = sum(rows * width for rows, width in shapes)
    if total == 0:
        return 0.0
    if not 0 <= real_positions <= total:
        raise ValueError(f"{real_positions} real positions do not fit in {total}")
    return 1.0 - real_positions / total


def micro_batch_padding(micro: Sequence[MicroBatch], lengths: np.ndarray) -> float:
    """Padding share of the micro-batches' `inputs`; `lengths` are the TrainBatch rows' real positions (row_lengths)."""
    shapes = [(int(m.inputs.shape[0]), int(m.inputs.shape[1])) for m in micro]
    real = sum(int(lengths[m.rows].sum()) for m in micro if m.rows is not None)
    return padding_share(shapes, real)


def batch_padding(batch: TrainBatch) -> float:
    """Padding share of the one padded [N, L] batch, before it is split."""
    rows, width = batch.mask.shape
    return padding_share([(int(rows), int(width))], int(row_lengths(np.array(batch.mask)).sum()))


def real_groups(model: Any, tokenizer: Any, shape: LeaseShape) -> list[AcceptedGroup]:
    """One lease sampled by the actor's path, as the learner accepts it; rewards spread 0..1 within each group."""
    from grpo_fleet.models.generation import SamplingSettings, generate_groups

    prompts = lease_prompts(tokenizer, shape.prompts)
    eos = tuple(sorted(int(t) for t in tokenizer.eos_token_ids))
    settings = SamplingSettings(group_size=shape.group_size, max_tokens=shape.max_tokens,
                                temperature=shape.temperature, stop_token_ids=eos)
    groups = generate_groups(model, prompts, settings)
    return [
        AcceptedGroup(
            group_id=f"g{index}", prompt_index=index, prompt_tokens=np.asarray(prompt, np.int32),
            completions=[CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32),
                                          i / (shape.group_size - 1), c.finish_reason) for i, c in enumerate(group)],
            policy_version=0, actor_id="bench",
        )
        for index, (prompt, group) in enumerate(zip(prompts, groups))
    ]


def measure(report: Report, model_dir: Path, shape: LeaseShape) -> None:
    from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
    from grpo_fleet.learner.step.batch import build_train_batch, split_batch
    from grpo_fleet.learner.step.trainer import Trainer
    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(model_dir), lora=LoraConfig(enabled=True, rank=8))
    groups = real_groups(policy.model, policy.tokenizer, shape)
    trainer = Trainer(policy, GRPOConfig(), OptimConfig(), temperature=shape.temperature, max_tokens=shape.max_tokens)
    trainer.step(build_train_batch(groups[:1]))  # warm-up
    batch = build_train_batch(groups)
    stats = trainer.step(batch)
    lengths = row_lengths(np.array(batch.mask))
    completion_tokens = int(sum(len(c.tokens) for g in groups for c in g.completions))
    all_tokens = int(lengths.sum()) + 1 * len(lengths)  # positions fed plus each row's last token
    micro = split_batch(batch, trainer.micro_batch_tokens)
    label = f"{model_dir.name}, LoRA r8, {len(groups)} groups x G={shape.group_size}"
    notes = (f"one step {stats.train_seconds:.2f}s (pi_ref {stats.ref_seconds:.2f}s), {len(micro)} micro-batches of "
             f"<= {trainer.micro_batch_tokens} tokens; {completion_tokens} completion tokens, {all_tokens} in all")
    report.add(Figure("real_step", f"learner step completion tok/s, {label}", completion_tokens / stats.train_seconds,
                      "tok/s", notes=notes))
    report.add(Figure("real_step", f"learner step tok/s, all tokens, {label}", all_tokens / stats.train_seconds,
                      "tok/s", notes=notes))
    report.add(Figure("real_step", f"micro-batch padding, {label}", 100 * micro_batch_padding(micro, lengths), "%",
                      baseline=100 * batch_padding(batch), baseline_name="one padded batch %",
                      notes="pad positions / positions in the micro-batches' inputs"))


def run(report: Report, scale: Scale, model_dir: Optional[Path] = None) -> None:
    shape = LeaseShape(prompts=2, max_tokens=16) if scale is Scale.QUICK else LeaseShape()
    directory = real_model_dir(model_dir)
    if not (directory / "config.json").exists():
        print(f"skipping real_step: no model at {directory} (set {REAL_MODEL_ENV})", flush=True)
        return
    measure(report, directory, shape)
