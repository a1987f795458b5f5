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
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.doctor import matmul_gflops
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.step.batch import build_train_batch, split_batch
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.model import load_policy

BENCH = "step_flops"
TIGHT_MICRO_BATCH_TOKENS = 1024  # the SmolLM2 lease again, split into more micro-batches of closer lengths
QWEN_BLOCKS = {Scale.QUICK: 1, Scale.DEFAULT: 4, Scale.FULL: 24}


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


def run(report: Report, scale: Scale) -> None:
    smollm(report, scale)
    qwen(report, scale)
