"""Benchmark 7: the learner step of the documented Qwen config, at its real shape.

Qwen2.5-0.5B-Instruct's architecture (`realshape:qwen2.5-0.5b`, all 24 blocks,
151,936-token vocabulary) with fp32 weights on this machine, LoRA r16 on the last
16 blocks, G = 8, 150-token prompts and 384-token completions, `dapo`, beta 0.04
with the pi_ref pass, and the config's memory settings (2048-token micro-batches,
grad checkpointing). Peak memory, seconds per step and tokens/s at growing batch
sizes: with micro-batching the peak should not grow with the batch. The quick
variant keeps the vocabulary and widths but 2 blocks and short sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from grpo_fleet.bench import Figure, Report
from grpo_fleet.bench.step import synthetic_groups
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.batch import build_train_batch
from grpo_fleet.learner.trainer import Trainer
from grpo_fleet.model import load_policy
from grpo_fleet.realshape import build_realshape

GIB = float(1 << 30)


@dataclass(frozen=True)
class Shape:
    layers: int
    prompt_tokens: int
    completion_tokens: int
    group_counts: tuple[int, ...]


FULL = Shape(layers=24, prompt_tokens=150, completion_tokens=384, group_counts=(2, 4, 8, 16))
QUICK = Shape(layers=1, prompt_tokens=32, completion_tokens=64, group_counts=(1, 2))
GROUP_SIZE = 8


def qwen_config_trainer(layers: int, completion_tokens: int) -> Trainer:
    """The flagship config's learner at `layers` blocks, fp32 weights."""
    path = build_realshape(f"realshape:qwen2.5-0.5b?layers={layers}")
    lora = LoraConfig(enabled=True, rank=16, scale=20.0, num_layers=min(16, layers))
    policy = load_policy(str(path), lora=lora, dtype="float32")
    grpo = GRPOConfig(beta=0.04, loss_type="dapo", epsilon_high=0.28, groups_per_step=16)
    return Trainer(policy, grpo, OptimConfig(lr=1e-5), temperature=0.9, max_tokens=completion_tokens,
                   micro_batch_tokens=2048, logprob_chunk_tokens=256, grad_checkpoint=True)


def measure(report: Report, shape: Shape) -> None:
    trainer = qwen_config_trainer(shape.layers, shape.completion_tokens)
    vocab = trainer.policy.vocab_size
    label = f"Qwen2.5-0.5B config step, {shape.layers} blocks, {shape.prompt_tokens}+{shape.completion_tokens} tokens"
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
    smallest, largest = min(peaks), max(peaks)
    report.add(Figure("qwen_step", f"{label}: peak at {largest} groups / at {smallest}", peaks[largest],
                      "GiB", baseline=peaks[smallest], baseline_name=f"GiB at {smallest} groups", goal="<= 1.15x"))


def run(report: Report, quick: bool) -> None:
    measure(report, QUICK if quick else FULL)
