"""Benchmark 5: where a learner step's time goes, with and without mx.compile.

Phases are timed separately with `mx.eval` barriers: data prep (packing groups
into arrays), the pi_ref forward, the policy forward, the backward pass and the
optimizer update. The whole step is then timed eager and compiled.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from grpo_fleet.bench import Figure, Report
from grpo_fleet.bench.models import model_50m, tiny_model
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord, batch_totals, build_train_batch, split_batch
from grpo_fleet.learner.trainer import Trainer, default_loss
from grpo_fleet.model import load_policy


def synthetic_groups(groups: int, group_size: int, prompt_len: int, completion_len: int, vocab: int) -> list[AcceptedGroup]:
    """Groups shaped like real rollouts (fixed seed, rewards spread so every group trains)."""
    rng = np.random.default_rng(0)
    return [
        AcceptedGroup(
            group_id=f"g{g}", prompt_index=g, prompt_tokens=rng.integers(0, vocab, prompt_len).astype(np.int32),
            completions=[
                CompletionRecord(rng.integers(0, vocab, completion_len).astype(np.int32),
                                 -rng.random(completion_len).astype(np.float32), float(i) / group_size, "length")
                for i in range(group_size)
            ],
            policy_version=0, actor_id="bench",
        )
        for g in range(groups)
    ]


def _mean_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (and compilation)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _trainer(path: Path, lora: bool, compiled: bool) -> Trainer:
    mx.random.seed(0)
    policy = load_policy(str(path), lora=LoraConfig(enabled=True, rank=8) if lora else None)
    ref = None if lora else load_policy(str(path)).model
    return Trainer(policy, GRPOConfig(beta=0.04), OptimConfig(lr=1e-5), temperature=1.0, max_tokens=64,
                   ref_model=ref, compile=compiled)


def _phases(trainer: Trainer, groups: list[AcceptedGroup], repeats: int) -> dict[str, float]:
    model, cfg = trainer.policy.model, trainer.grpo
    batch = build_train_batch(groups)
    micro = split_batch(batch, trainer.micro_batch_tokens)
    totals = batch_totals(batch)
    refs = trainer._references(micro)

    def forward():
        for part, ref in zip(micro, refs):
            loss, _ = default_loss(model, part, ref, totals, grpo=cfg, temperature=1.0, max_tokens=64,
                                   chunk_tokens=trainer.chunk_tokens)
            mx.eval(loss)

    gradients = trainer.accumulate(micro, refs, totals)

    phases = {
        "data prep": _mean_ms(lambda: split_batch(build_train_batch(groups), trainer.micro_batch_tokens), repeats),
        "ref forward": _mean_ms(lambda: trainer._references(micro), repeats),
        "forward": _mean_ms(forward, repeats),
        "forward+backward": _mean_ms(lambda: trainer.accumulate(micro, refs, totals), repeats),
        "optimizer": _mean_ms(lambda: trainer.apply(gradients), repeats),
    }
    phases["backward"] = phases.pop("forward+backward") - phases["forward"]
    return phases


def _measure(report: Report, label: str, path: Path, lora: bool, shape: tuple[int, int, int, int], repeats: int) -> None:
    groups = synthetic_groups(*shape, vocab=16)
    for phase, ms in _phases(_trainer(path, lora, compiled=False), groups, repeats).items():
        report.add(Figure("step", f"{label}: {phase}", ms, "ms"))
    batch = build_train_batch(groups)
    eager_trainer, fast_trainer = _trainer(path, lora, compiled=False), _trainer(path, lora, compiled=True)
    eager = _mean_ms(lambda: eager_trainer.step(batch), repeats)
    fast = _mean_ms(lambda: fast_trainer.step(batch), repeats)
    report.add(Figure("step", f"{label}: whole step, mx.compile", fast, "ms", baseline=eager,
                      baseline_name="eager ms", goal="with and without mx.compile"))


def run(report: Report, quick: bool) -> None:
    repeats = 5 if quick else 20
    with tempfile.TemporaryDirectory(prefix="grpo-bench-step-") as tmp:
        root = Path(tmp)
        # The demo's batch: 8 groups of 8, 4-token prompts, 5-token completions, full fine-tuning.
        _measure(report, "tiny model, demo batch, full FT", tiny_model(root), False, (8, 8, 4, 5), repeats)
        if not quick:
            # A 50M model with LoRA: 4 groups of 8, 32-token prompts, 64-token completions.
            _measure(report, "50M model, LoRA r8", model_50m(root), True, (4, 8, 32, 64), 5)
