"""Benchmark 5: where a learner step's time goes, with and without mx.compile, and
what the memory-bounded step saves against the one-shot update at a real vocabulary.

Phases are timed separately with `mx.eval` barriers: data prep (packing groups
into arrays), the pi_ref forward, the policy forward, the backward pass and the
optimizer update. The whole step is then timed eager and compiled.
`memory_comparison` runs a Qwen2.5-0.5B-shaped model (151,936-token vocabulary,
fewer blocks) through the old dense update and through `Trainer.step`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.models import model_50m, tiny_model
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import TrainBatch, batch_totals, build_train_batch, split_batch
from grpo_fleet.learner.step.grpo import grpo_loss
from grpo_fleet.learner.step.objective import default_loss, policy_logprobs
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import Policy, adapters_disabled, apply_lora, load_policy


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
    refs = trainer.references(micro)

    def forward() -> None:
        for part, ref in zip(micro, refs):
            out = default_loss(model, part, ref, totals, grpo=cfg, temperature=1.0, max_tokens=64,
                               chunk_tokens=trainer.chunk_tokens)
            mx.eval(out.loss)

    gradients = trainer.accumulate(micro, refs, totals)

    phases = {
        "data prep": _mean_ms(lambda: split_batch(build_train_batch(groups), trainer.micro_batch_tokens), repeats),
        "ref forward": _mean_ms(lambda: trainer.references(micro), repeats),
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


def qwen_shaped_policy(layers: int, lora: LoraConfig) -> Policy:
    """Qwen2.5-0.5B's widths and tied 151,936-token vocabulary, random weights, `layers` blocks."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=896, num_hidden_layers=layers, intermediate_size=4864,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=151936,
        rope_theta=1e6, tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    apply_lora(model, lora)
    model.train(False)
    return Policy(model=model, tokenizer=None, path="qwen2.5-0.5b-shaped", lora=lora, vocab_size=args.vocab_size)


def one_shot_step(trainer: Trainer, batch: TrainBatch) -> None:
    """The update as it was: dense [N, L, V] logits at every position, one batch, clip, AdamW."""
    model, cfg = trainer.policy.model, trainer.grpo
    with adapters_disabled(model):
        ref = mx.stop_gradient(policy_logprobs(model, batch.inputs, batch.targets, trainer.temperature))
        mx.eval(ref)

    def loss(inputs: mx.array, targets: mx.array) -> mx.array:
        lp = policy_logprobs(model, inputs, targets, trainer.temperature)
        return grpo_loss(lp, batch.old_logprobs, batch.advantages, batch.mask, ref_logprobs=ref, beta=cfg.beta,
                         loss_type=cfg.loss_type, max_tokens=batch.mask.shape[1])[0]

    _, grads = nn.value_and_grad(model, loss)(batch.inputs, batch.targets)
    grads, _ = optim.clip_grad_norm(grads, trainer.optim_cfg.grad_clip)
    trainer.optimizer.update(model, grads)
    mx.eval(model.trainable_parameters(), trainer.optimizer.state)


def _peak_and_seconds(fn: Callable[[], object], headroom: int) -> tuple[int, int, float]:
    """(peak bytes, peak above what was resident before, seconds) of one call after a warm-up.

    The timed call runs under an MLX memory limit of resident + `headroom`, so
    evaluation is throttled the way `train.memory_limit_gb` throttles a learner.
    """
    fn()
    mx.clear_cache()
    resident = mx.get_active_memory()
    previous = mx.set_memory_limit(resident + headroom)
    try:
        mx.reset_peak_memory()
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        peak = mx.get_peak_memory()
    finally:
        mx.set_memory_limit(previous)
    return peak, peak - resident, seconds


def memory_comparison(report: Report, *, layers: int = 2, shape: tuple[int, int, int, int] = (2, 4, 64, 128),
                      micro_batch_tokens: int = 1024, chunk_tokens: int = 256, headroom: int = 512 << 20) -> None:
    """Peak memory and seconds per step: the one-shot dense update vs `Trainer.step`, LoRA r8, beta > 0."""
    policy = qwen_shaped_policy(layers, LoraConfig(enabled=True, rank=8))
    trainer = Trainer(policy, GRPOConfig(beta=0.04), OptimConfig(lr=1e-5), temperature=1.0, max_tokens=shape[3],
                      micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=chunk_tokens)
    batch = build_train_batch(synthetic_groups(*shape, vocab=policy.vocab_size))
    label = f"Qwen2.5-0.5B widths, {layers} blocks, V=151936, {batch.inputs.shape[0]}x{batch.inputs.shape[1]}"
    old_peak, old_above, old_seconds = _peak_and_seconds(lambda: one_shot_step(trainer, batch), headroom)
    new_peak, new_above, new_seconds = _peak_and_seconds(lambda: trainer.step(batch), headroom)
    gib = float(1 << 30)
    report.add(Figure("step", f"{label}: peak memory", new_peak / gib, "GiB", baseline=old_peak / gib,
                      baseline_name="one-shot GiB", goal="no [N, L, V] array"))
    report.add(Figure("step", f"{label}: peak above resident weights", new_above / gib, "GiB",
                      baseline=old_above / gib, baseline_name="one-shot GiB"))
    report.add(Figure("step", f"{label}: seconds per step", new_seconds, "s", baseline=old_seconds,
                      baseline_name="one-shot s"))


def run(report: Report, scale: Scale) -> None:
    repeats = 5 if scale is Scale.QUICK else 20
    with tempfile.TemporaryDirectory(prefix="grpo-bench-step-") as tmp:
        root = Path(tmp)
        # The demo's batch: 8 groups of 8, 4-token prompts, 5-token completions, full fine-tuning.
        _measure(report, "tiny model, demo batch, full FT", tiny_model(root), False, (8, 8, 4, 5), repeats)
        if scale is Scale.FULL:  # about 4 minutes here; the real-model step (real_step) runs by default
            # A 50M model with LoRA: 4 groups of 8, 32-token prompts, 64-token completions.
            _measure(report, "50M model, LoRA r8", model_50m(root), True, (4, 8, 32, 64), 5)
            memory_comparison(report)
