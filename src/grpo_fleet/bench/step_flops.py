"""Benchmark: the learner's step against the limit: achieved FLOP/s over the matmul GF/s `doctor` measures.

Two steps of `Trainer.step`, each after a warm-up step:
- SmolLM2-135M-Instruct (the zoo's real model), LoRA r8 and the config's GRPO
  defaults (beta 0.04: the pi_ref pass runs), on one lease of real completions
  sampled by the actor's path (`real_step.real_groups`), whose lengths differ;
- Qwen2.5-0.5B's shape (`realshape:`, the flagship config: LoRA r16 on the last
  16 blocks, grad checkpointing, 2048-token micro-batches), fewer blocks at the
  default scale (the widths and the 151,936-token head are Qwen's).

FLOPs are counted from the model's shape and the batch's real positions
(`bench.flops`: the frozen base's forward and activation gradient included,
its weight gradient not, recomputation and padding apart), over the step's
wall seconds, next to `doctor.matmul_gflops()` measured in the same process
just before and after the step (their mean: on a shared host both move with
the load, which is noted). What bounds it is measured beside it: the pi_ref
pass alone (a plain forward), and a matmul at the step's own shapes (the MLP's
[positions x hidden] @ [hidden x ff], the head's [chunk x hidden] @
[hidden x vocab]). For padding, the SmolLM2 step is timed again with
micro-batches split tighter by length.

Long answers (issue 38): the same figures at 128, 512 and 1,024 completion
tokens after a 60-token prompt (SmolLM2-135M LoRA r8 and the Qwen shape, on
synthetic completions: FLOPs do not depend on which tokens), with the pi_ref
pass's share of the step (what `grpo.beta = 0` would save); and the padding the
micro-batch planner leaves for completions spread uniformly over 16..512 tokens
(8 groups x G = 8, the default `train.micro_batch_tokens`; no model runs).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.flops import StepFlops, forward_flops, head_dims, linear_dims, model_shape, step_flops
from grpo_fleet.bench.real_decode import LeaseShape, real_model_dir
from grpo_fleet.bench.real_step import real_groups
from grpo_fleet.bench.step import synthetic_groups
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig, TrainConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import build_train_batch, row_lengths, split_batch
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import load_policy
from grpo_fleet.runtime.doctor import matmul_gflops

BENCH = "step_flops"
TIGHT_MICRO_BATCH_TOKENS = 1024  # the SmolLM2 lease again, split into more micro-batches of closer lengths
QWEN_BLOCKS = {Scale.QUICK: 1, Scale.DEFAULT: 4, Scale.FULL: 24}
LONG_COMPLETIONS = (128, 512, 1024)  # completion tokens of the long-answer steps
LONG_PROMPT = 60
LONG_ROWS = {Scale.QUICK: 1, Scale.DEFAULT: 2, Scale.FULL: 8}  # completions a long-answer step trains on
SPREAD = (16, 512)  # completion lengths of the padding figure, uniform


@dataclass(frozen=True)
class Measured:
    label: str
    flops: StepFlops
    seconds: float
    ref_seconds: float
    ref_flops: float  # the pi_ref pass: one plain forward at real positions
    micro_batches: int
    doctor: float  # doctor's matmul GF/s, the mean of one just before and one just after the step
    load_average: float  # the host's 1-minute load average after the step


def gflops_at(m: int, k: int, n: int, repeats: int = 3) -> float:
    """fp32 [m, k] @ [k, n] GF/s on the default device (a warm-up, then the mean of `repeats`)."""
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a @ b)
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2.0 * m * k * n * repeats / (time.perf_counter() - started) / 1e9


def timed_step(trainer: Trainer, groups: list[AcceptedGroup], label: str, warm_up: list[AcceptedGroup]) -> Measured:
    """One step on `groups` (after a warm-up step on `warm_up`), with its FLOPs."""
    trainer.step(build_train_batch(warm_up))
    batch = build_train_batch(groups)
    micro = split_batch(batch, trainer.micro_batch_tokens)
    shape = model_shape(trainer.policy.model)
    reference = trainer.grpo.beta > 0
    counted = step_flops(shape, np.array(batch.mask), micro, reference=reference,
                         grad_checkpoint=getattr(type(trainer.policy.model.layers[0]), "_grpo_fleet_checkpointed", False))
    before = matmul_gflops()
    started = time.perf_counter()
    stats = trainer.step(batch)
    seconds = time.perf_counter() - started
    doctor = (before + matmul_gflops()) / 2
    return Measured(label, counted, seconds, stats.ref_seconds if reference else 0.0,
                    forward_flops(shape, np.array(batch.mask)), len(micro),
                    doctor, os.getloadavg()[0])


def report_step(report: Report, measured: Measured, shape_rates: dict[str, float]) -> None:
    flops, label, doctor = measured.flops, measured.label, measured.doctor
    achieved = flops.useful / measured.seconds / 1e9
    notes = (f"{flops.useful / 1e12:.2f} TFLOP useful over {flops.real_positions} real positions in "
             f"{measured.seconds:.1f} s ({measured.micro_batches} micro-batches); executed {flops.executed / 1e12:.2f} "
             f"TFLOP with recomputation and padding; doctor's 1024^3 fp32 matmul {doctor:.1f} GF/s beside it; "
             f"load average {measured.load_average:.1f}")
    report.add(Figure(BENCH, f"{label}: achieved GF/s (useful FLOPs / step seconds)", achieved, "GF/s",
                      baseline=doctor, baseline_name="doctor matmul GF/s", notes=notes))
    report.add(Figure(BENCH, f"{label}: executed GF/s (recomputation and padding included)",
                      flops.executed / measured.seconds / 1e9, "GF/s", baseline=doctor, baseline_name="doctor matmul GF/s"))
    if measured.ref_seconds > 0:
        report.add(Figure(BENCH, f"{label}: the pi_ref pass alone (a plain forward), GF/s",
                          measured.ref_flops / measured.ref_seconds / 1e9, "GF/s", baseline=doctor,
                          baseline_name="doctor matmul GF/s",
                          notes=f"{measured.ref_seconds:.1f} s of the step's {measured.seconds:.1f} s"))
    for name, rate in shape_rates.items():
        report.add(Figure(BENCH, f"{label}: matmul at the step's shape, {name}", rate, "GF/s", baseline=doctor,
                          baseline_name="doctor matmul GF/s"))
    report.add(Figure(BENCH, f"{label}: padded positions the model runs on, over real ones",
                      flops.padded_positions / flops.real_positions, "x",
                      notes=f"{flops.padded_positions} padded (rows x width over the micro-batches) for "
                      f"{flops.real_positions} real positions; padding {flops.padding / 1e12:.3f} TFLOP; "
                      f"{flops.unrounded_positions} if each micro-batch were as wide as its longest row "
                      "(the rest is the 16-token length bucket)"))


def step_shapes(model: Any, positions: int, chunk: int) -> dict[str, float]:
    """GF/s of the step's two largest matmuls at its own sizes: the MLP's up-projection and the LM head's chunk."""
    hidden, mlp = linear_dims(model.layers[0].mlp.gate_proj)
    _, vocab = head_dims(model)
    return {f"MLP [{positions} x {hidden}] @ [{hidden} x {mlp}]": gflops_at(positions, hidden, mlp),
            f"LM head [{chunk} x {hidden}] @ [{hidden} x {vocab}]": gflops_at(chunk, hidden, vocab)}


def _largest_micro_batch(trainer: Trainer, groups: list[AcceptedGroup]) -> int:
    return max(m.padded_tokens for m in split_batch(build_train_batch(groups), trainer.micro_batch_tokens))


def smollm(report: Report, scale: Scale) -> None:
    """SmolLM2-135M, LoRA r8, the config's GRPO defaults, on one lease of real completions; then split tighter."""
    lease = LeaseShape(prompts=2, max_tokens=16) if scale is Scale.QUICK else LeaseShape()
    policy = load_policy(str(real_model_dir()), lora=LoraConfig(enabled=True, rank=8))
    groups = real_groups(policy.model, policy.tokenizer, lease)
    label = f"SmolLM2-135M LoRA r8, {len(groups)} groups x G={lease.group_size}, real completions"
    trainer = Trainer(policy, GRPOConfig(), OptimConfig(), temperature=lease.temperature, max_tokens=lease.max_tokens)
    measured = timed_step(trainer, groups, label, groups[:1])
    rates = step_shapes(policy.model, _largest_micro_batch(trainer, groups), trainer.chunk_tokens)
    report_step(report, measured, rates)
    trainer.micro_batch_tokens = TIGHT_MICRO_BATCH_TOKENS
    tight = timed_step(trainer, groups, label, groups[:1])
    report.add(Figure(
        BENCH, f"{label}: step seconds, micro-batches of <= {TIGHT_MICRO_BATCH_TOKENS} tokens", tight.seconds, "s",
        baseline=measured.seconds, baseline_name=f"one step at the default {measured.micro_batches} micro-batch(es)",
        notes=f"{tight.micro_batches} micro-batches, padded/real positions "
        f"{tight.flops.padded_positions / tight.flops.real_positions:.3f} against "
        f"{measured.flops.padded_positions / measured.flops.real_positions:.3f}",
    ))


def qwen(report: Report, scale: Scale) -> None:
    """The flagship config at Qwen2.5-0.5B's shape, on synthetic groups of 150 + 384 tokens."""
    from grpo_fleet.bench.qwen_step import GROUP_SIZE, qwen_config_trainer

    blocks = QWEN_BLOCKS[scale]
    prompt, completion = (32, 64) if scale is Scale.QUICK else (150, 384)
    trainer = qwen_config_trainer(blocks, completion)
    groups = synthetic_groups(1 if scale is not Scale.FULL else 2, GROUP_SIZE, prompt, completion,
                              trainer.policy.vocab_size)
    label = (f"Qwen2.5-0.5B shape, {blocks} of 24 blocks, LoRA r16, {len(groups)} group(s) x G={GROUP_SIZE} x "
             f"{prompt}+{completion}")
    warm_up = synthetic_groups(1, 2, 16, 16, trainer.policy.vocab_size)  # a small step: the shapes differ anyway
    measured = timed_step(trainer, groups, label, warm_up)
    report_step(report, measured, step_shapes(trainer.policy.model, _largest_micro_batch(trainer, groups),
                                                      trainer.chunk_tokens))


def spread_groups(groups: int, group_size: int, lengths: tuple[int, int], vocab: int,
                  seed: int = 0) -> list[AcceptedGroup]:
    """Groups after LONG_PROMPT-token prompts whose completions are drawn uniformly from `lengths` (inclusive)."""
    rng = np.random.default_rng(seed)
    low, high = lengths
    return [AcceptedGroup(f"g{g}", g, rng.integers(0, vocab, LONG_PROMPT).astype(np.int32), [
        CompletionRecord(rng.integers(0, vocab, n).astype(np.int32), -rng.random(n).astype(np.float32),
                         float(i) / group_size, "stop")
        for i, n in enumerate(rng.integers(low, high + 1, group_size).tolist())], 0, "bench") for g in range(groups)]


def spread_padding(report: Report) -> None:
    """Padded over real positions as the planner cuts 8 groups x G = 8 of completions spread over SPREAD."""
    budget = TrainConfig().micro_batch_tokens
    ratios, counts = [], []
    for seed in range(5):
        batch = build_train_batch(spread_groups(8, 8, SPREAD, 1000, seed))
        micro = split_batch(batch, budget)
        ratios.append(sum(m.padded_tokens for m in micro) / int(row_lengths(np.array(batch.mask)).sum()))
        counts.append(len(micro))
    report.add(Figure(BENCH, f"padded positions over real ones, completions spread {SPREAD[0]}..{SPREAD[1]}",
                      max(ratios), "x", goal="<= 1.05",
                      notes=f"worst of 5 draws of 8 groups x G=8 after {LONG_PROMPT}-token prompts, at the default "
                      f"{budget}-token micro-batches: {', '.join(f'{r:.3f}' for r in ratios)}, in "
                      f"{min(counts)}-{max(counts)} micro-batches"))


def report_long(report: Report, measured: Measured, completion: int) -> None:
    """Achieved GF/s against doctor's, padding, and the pi_ref pass's share of the step, at one length."""
    flops = measured.flops
    report.add(Figure(BENCH, f"{measured.label}: achieved GF/s (useful FLOPs / step seconds)",
                      flops.useful / measured.seconds / 1e9, "GF/s", baseline=measured.doctor,
                      baseline_name="doctor matmul GF/s", goal=">= 0.45x at 512 tokens (SmolLM2)" if completion == 512
                      else None, notes=f"{measured.seconds:.1f} s, {measured.micro_batches} micro-batches, padded/real "
                      f"{flops.padded_positions / flops.real_positions:.3f}; load average {measured.load_average:.1f}"))
    if measured.ref_seconds > 0:
        report.add(Figure(BENCH, f"{measured.label}: the pi_ref pass's share of the step (beta > 0)",
                          measured.ref_seconds / measured.seconds, "share",
                          notes=f"{measured.ref_seconds:.1f} s of {measured.seconds:.1f} s: what grpo.beta = 0 saves"))


def long_answers(report: Report, scale: Scale) -> None:
    """SmolLM2-135M LoRA r8 (beta 0.04) and the Qwen shape, at LONG_COMPLETIONS completion tokens."""
    from grpo_fleet.bench.qwen_step import qwen_config_trainer

    rows = LONG_ROWS[scale]
    policy = load_policy(str(real_model_dir()), lora=LoraConfig(enabled=True, rank=8))
    smol = Trainer(policy, GRPOConfig(), OptimConfig(), temperature=1.0, max_tokens=max(LONG_COMPLETIONS))
    trainers = {"SmolLM2-135M LoRA r8": smol,
                f"Qwen2.5-0.5B shape, {QWEN_BLOCKS[scale]} blocks, LoRA r16": qwen_config_trainer(
                    QWEN_BLOCKS[scale], max(LONG_COMPLETIONS))}
    for name, trainer in trainers.items():
        vocab = trainer.policy.vocab_size
        for completion in LONG_COMPLETIONS:
            groups = spread_groups(1, rows, (completion, completion), vocab)
            label = f"{name}, {rows} x {LONG_PROMPT}+{completion} tokens"
            # Warmed up on the same groups: the timed step traces no new shape.
            report_long(report, timed_step(trainer, groups, label, groups), completion)


def run(report: Report, scale: Scale) -> None:
    spread_padding(report)
    smollm(report, scale)
    qwen(report, scale)
    long_answers(report, scale)
