"""Benchmark 7: the documented Qwen config at its real shape: the learner step and one actor lease.

Qwen2.5-0.5B-Instruct's architecture (`realshape:qwen2.5-0.5b`, all 24 blocks,
151,936-token vocabulary) with fp32 weights on this machine, LoRA r16 on the last
16 blocks, G = 8, 150-token prompts and 384-token completions, `dapo`, beta 0.04
with the pi_ref pass, and the config's memory settings (2048-token micro-batches,
grad checkpointing). Three parts, in this order:

* one actor lease (G = 8 completions of 384 tokens) in fp32, and a shorter one
  in bf16: tokens/s and peak memory;
* the one-shot dense update against `Trainer.step` on the largest batch the
  one-shot path fits here, eager and compiled, with and without checkpointing;
* peak memory, seconds per step and tokens/s at growing batch sizes: with
  micro-batching the peak should not grow with the batch.

mlx-lm's grad checkpointing patches the block class for the whole process, so
the unchecked variants run first. The quick variant keeps the vocabulary and
widths but 1 block and short sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import mlx.core as mx
import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.step import one_shot_step, synthetic_groups
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.step.batch import TrainBatch, build_train_batch
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.generation import SamplingSettings, generate_groups
from grpo_fleet.models.loading import Policy, load_policy
from grpo_fleet.models.realshape import build_realshape

GIB = float(1 << 30)
FLAGSHIP_MICRO_BATCH_TOKENS = 2048  # the flagship config's train.micro_batch_tokens


@dataclass(frozen=True)
class Shape:
    layers: int
    prompt_tokens: int
    completion_tokens: int
    group_counts: tuple[int, ...]
    one_shot_sequences: int  # the one-shot path's batch: what it fits in this machine's 24 GB at FULL
    bf16_actor_tokens: int  # bf16 decoding is ~3x slower than fp32 on this CPU, so its lease is shorter
    micro_batch_tokens: int = FLAGSHIP_MICRO_BATCH_TOKENS


FULL = Shape(layers=24, prompt_tokens=150, completion_tokens=384, group_counts=(2, 8, 16), one_shot_sequences=4,
             bf16_actor_tokens=64)
QUICK = Shape(layers=1, prompt_tokens=32, completion_tokens=64, group_counts=(1, 2), one_shot_sequences=4,
              bf16_actor_tokens=16)
GROUP_SIZE = 8


def config_policy(layers: int, dtype: str = "float32") -> Policy:
    """The flagship config's policy at `layers` blocks: LoRA r16 on the last 16 blocks."""
    path = build_realshape(f"realshape:qwen2.5-0.5b?layers={layers}")
    lora = LoraConfig(enabled=True, rank=16, scale=20.0, num_layers=min(16, layers))
    return load_policy(str(path), lora=lora, dtype=dtype)


def qwen_config_trainer(layers: int, completion_tokens: int, *, grad_checkpoint: bool = True,
                        compile: bool = False, micro_batch_tokens: int = FLAGSHIP_MICRO_BATCH_TOKENS) -> Trainer:
    """The flagship config's learner at `layers` blocks, fp32 weights."""
    grpo = GRPOConfig(beta=0.04, loss_type="dapo", epsilon_high=0.28, groups_per_step=16)
    return Trainer(config_policy(layers), grpo, OptimConfig(lr=1e-5), temperature=0.9,
                   max_tokens=completion_tokens, micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=256,
                   grad_checkpoint=grad_checkpoint, compile=compile)


def _label(shape: Shape) -> str:
    return f"Qwen2.5-0.5B config, {shape.layers} blocks, {shape.prompt_tokens}+{shape.completion_tokens} tokens"


def _peak_and_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """(peak GiB, seconds) of one call: at FULL a call is minutes, so there is no warm-up."""
    mx.clear_cache()
    mx.reset_peak_memory()
    started = time.perf_counter()
    fn()
    return mx.get_peak_memory() / GIB, time.perf_counter() - started


def measure_actor(report: Report, shape: Shape) -> None:
    """One lease as the actor runs it, in fp32 (this CPU's dtype) and in bf16 (what a Mac holds)."""
    _actor_lease(report, shape, "float32", shape.completion_tokens)
    _actor_lease(report, shape, "bfloat16", shape.bf16_actor_tokens)


def _actor_lease(report: Report, shape: Shape, dtype: str, completion_tokens: int) -> None:
    """One prompt, G completions of `completion_tokens` (no stop tokens, so every one runs the full length)."""
    policy = config_policy(shape.layers, dtype)
    prompt = np.random.default_rng(0).integers(0, policy.vocab_size, shape.prompt_tokens).tolist()
    settings = SamplingSettings(group_size=GROUP_SIZE, max_tokens=completion_tokens, temperature=0.9)
    weights = mx.get_active_memory() / GIB
    # partial, not a lambda: the `del policy` below must not leave a closure over a deleted name.
    peak, seconds = _peak_and_seconds(partial(generate_groups, policy.model, [prompt], settings))
    label = f"{_label(shape)}, actor lease of G={GROUP_SIZE} x {completion_tokens} tokens, {dtype}"
    report.add(Figure("qwen_step", f"{label}: peak memory", peak, "GiB", goal="<= 2 GB",
                      notes=f"weights alone {weights:.3f} GiB"))
    report.add(Figure("qwen_step", f"{label}: tokens/s", GROUP_SIZE * completion_tokens / seconds, "tok/s"))
    del policy
    mx.clear_cache()


def compare_paths(report: Report, shape: Shape) -> None:
    """The one-shot dense update against `Trainer.step`, eager and compiled, on one batch."""
    groups = synthetic_groups(1, shape.one_shot_sequences, shape.prompt_tokens, shape.completion_tokens, 151936)
    batch = build_train_batch(groups)
    label = f"{_label(shape)}, {shape.one_shot_sequences} sequences"
    old_peak, old_seconds = _run_once(one_shot_step, shape, batch, grad_checkpoint=False)
    report.add(Figure("qwen_step", f"{label}: one-shot dense update, peak memory", old_peak, "GiB"))
    variants = (("Trainer.step eager", False, False), ("Trainer.step mx.compile", False, True),
                ("Trainer.step eager + grad checkpoint (the config)", True, False))
    for name, checkpoint, compiled in variants:
        peak, seconds = _run_once(lambda t, b: t.step(b), shape, batch, grad_checkpoint=checkpoint,
                                  compile=compiled)
        report.add(Figure("qwen_step", f"{label}: {name}, peak memory", peak, "GiB", baseline=old_peak,
                          baseline_name="one-shot GiB"))
        report.add(Figure("qwen_step", f"{label}: {name}, seconds per step", seconds, "s",
                          baseline=old_seconds, baseline_name="one-shot s", goal="<= 1.2x"))


def _run_once(fn: Callable[[Trainer, TrainBatch], object], shape: Shape, batch: TrainBatch, *,
              grad_checkpoint: bool, compile: bool = False) -> tuple[float, float]:
    trainer = qwen_config_trainer(shape.layers, shape.completion_tokens, grad_checkpoint=grad_checkpoint,
                                  compile=compile)
    try:
        return _peak_and_seconds(partial(fn, trainer, batch))
    finally:
        del trainer
        mx.clear_cache()


def measure(report: Report, shape: Shape) -> None:
    """The config's step at each of `shape.group_counts` groups: peak memory, seconds and tokens/s."""
    trainer = qwen_config_trainer(shape.layers, shape.completion_tokens, micro_batch_tokens=shape.micro_batch_tokens)
    vocab = trainer.policy.vocab_size
    label = f"{_label(shape)} step"
    peaks: dict[int, float] = {}
    for groups in shape.group_counts:
        batch = build_train_batch(synthetic_groups(groups, GROUP_SIZE, shape.prompt_tokens,
                                                   shape.completion_tokens, vocab))
        started = time.perf_counter()
        stats = trainer.step(batch)
        seconds = time.perf_counter() - started
        tokens = groups * GROUP_SIZE * (shape.prompt_tokens + shape.completion_tokens)
        peaks[groups] = stats.peak_memory_bytes / GIB
        report.add(Figure("qwen_step", f"{label}, {groups} groups: peak memory", peaks[groups], "GiB",
                          goal="<= 6 GB at 16 groups"))
        report.add(Figure("qwen_step", f"{label}, {groups} groups: seconds per step", seconds, "s"))
        report.add(Figure("qwen_step", f"{label}, {groups} groups: tokens/s", tokens / seconds, "tok/s"))
        mx.clear_cache()
    smallest = min(peaks)
    for groups in sorted(peaks)[1:]:
        report.add(Figure("qwen_step", f"{label}: peak at {groups} groups / at {smallest}", peaks[groups],
                          "GiB", baseline=peaks[smallest], baseline_name=f"GiB at {smallest} groups",
                          goal="<= 1.15x"))


def run(report: Report, scale: Scale) -> None:
    shape = QUICK if scale is Scale.QUICK else FULL
    measure_actor(report, shape)
    compare_paths(report, shape)
    measure(report, shape)
