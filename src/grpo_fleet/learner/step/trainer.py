"""The memory-bounded MLX update: micro-batches, chunked logprobs, accumulation, AdamW.

A step splits the batch into token-budgeted micro-batches (`batch.split_batch`),
runs pi_ref (and, for the decoupled objective at ppo_epochs > 1, pi_prox: the
policy before the update) and then the policy on each, logprobs at completion
positions only (`forward.completion_logprobs`), and accumulates gradients with
the loss's batch-global normaliser, so the sum equals the one-batch gradient. Gradients
and the update are separate: a non-finite loss or gradient norm skips the update
and leaves weights and optimizer state exactly as they were.

The loss is a parameter (`loss`, objective.py's `Loss`) so a new objective plugs in
without forking the trainer; the default (`GRPO_LOSS`) wraps `grpo.grpo_loss`, and
a run's config chooses it (grpo.loss: `trainer_from_config`). Whichever it is, a
checked step compares the actors' logprobs with the step's own (`check_fused`).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from grpo_fleet.config import GRPOConfig, OptimConfig, RunConfig, TrainConfig
from grpo_fleet.learner.step.attention import use_fast_functions
from grpo_fleet.learner.step.batch import MicroBatch, TrainBatch, batch_totals, split_batch
from grpo_fleet.learner.step.compiled import MAX_COMPILED_SHAPES, CompiledUpdate
from grpo_fleet.learner.step.forward import enable_grad_checkpoint
from grpo_fleet.learner.step.frozen_forwards import FrozenForwards
from grpo_fleet.learner.step.fused_check import CheckedGroup, fused_check
from grpo_fleet.learner.step.memory import trim_cache
from grpo_fleet.learner.step.objective import (
    GRPO_LOSS,
    Loss,
    LossOutput,
    behaviour_correction,
    loss_named,
    offpolicy_summary,
)
from grpo_fleet.learner.step.recheck import check_older, slowest_check
from grpo_fleet.learner.step.rows import Sharding, SingleProcess
from grpo_fleet.learner.step.schedule import learning_rate_schedule, with_decay_steps
from grpo_fleet.learner.step.step_result import (
    LOGPROB_MISMATCH,
    LOGPROB_SCREEN,
    Gradients,
    StepStats,
    global_norm,
    skip_reason,
)
from grpo_fleet.models.loading import Policy, load_policy
from grpo_fleet.runtime.trees import scalar

_TRAIN_DEFAULTS = TrainConfig()


class Trainer:
    """Owns the optimizer; each step accumulates micro-batch gradients, then clips and applies them."""

    def __init__(
        self, policy: Policy, grpo: GRPOConfig, optim_cfg: OptimConfig, *, temperature: float, max_tokens: int,
        ref_model: Optional[nn.Module] = None, loss: Loss = GRPO_LOSS, compile: bool = False,
        micro_batch_tokens: int = _TRAIN_DEFAULTS.micro_batch_tokens,
        logprob_chunk_tokens: int = _TRAIN_DEFAULTS.logprob_chunk_tokens,
        grad_checkpoint: bool = _TRAIN_DEFAULTS.grad_checkpoint,
        attention_chunk_tokens: Optional[int] = _TRAIN_DEFAULTS.attention_chunk_tokens,
        native_exp: bool = _TRAIN_DEFAULTS.native_exp, numpy_exp: bool = _TRAIN_DEFAULTS.numpy_exp,
        memory_limit_bytes: Optional[int] = None, max_compiled_shapes: int = MAX_COMPILED_SHAPES,
    ) -> None:
        self.policy, self.grpo, self.optim_cfg = policy, grpo, optim_cfg
        self.temperature, self.ref_model = temperature, ref_model
        self.micro_batch_tokens, self.chunk_tokens = micro_batch_tokens, logprob_chunk_tokens
        if grad_checkpoint:
            enable_grad_checkpoint(policy.model)
        use_fast_functions(policy.model, attention_chunk_tokens, native_exp=native_exp,
                           numpy_exp=numpy_exp and not compile)
        if memory_limit_bytes is not None:
            # Process-wide: MLX throttles evaluation past it, so chained chunks really run one at a time.
            mx.set_memory_limit(memory_limit_bytes)
        self.loss = loss
        self.frozen = FrozenForwards(policy, grpo, ref_model, temperature=temperature,
                                     chunk_tokens=logprob_chunk_tokens, loss_returns_logprobs=loss.gives_policy_logprobs)
        bound = partial(loss.fn, grpo=grpo, temperature=temperature, max_tokens=max_tokens,
                        chunk_tokens=logprob_chunk_tokens)

        def differentiated(model: nn.Module, micro: MicroBatch, ref: Optional[mx.array],
                           totals: mx.array) -> tuple[mx.array, dict[str, mx.array], list[mx.array]]:
            # value_and_grad differentiates the first output; the others must be trees of arrays, not a record.
            out: LossOutput = bound(model, micro, ref, totals)
            return out.loss, out.statistics, [] if out.policy_logprobs is None else [out.policy_logprobs]

        self._value_and_grad = nn.value_and_grad(policy.model, differentiated)
        self.optimizer = optim.AdamW(
            learning_rate=learning_rate_schedule(optim_cfg), betas=list(optim_cfg.betas), weight_decay=optim_cfg.weight_decay
        )
        self.optimizer.init(policy.model.trainable_parameters())
        # Materialize now: lazy arrays belong to the creating thread's stream, and
        # the learner trains on its own thread.
        mx.eval(self.optimizer.state)
        self.compiled, self.max_compiled_shapes = compile, max_compiled_shapes
        self.compiled_update = self._compile() if compile else None
        self.sharding: Sharding = SingleProcess()

    def _compile(self) -> CompiledUpdate:
        return CompiledUpdate(self.policy.model, self.optimizer, self._grads, self._apply_update,
                              self.max_compiled_shapes)

    def _grads(self, micro: MicroBatch, ref: Optional[mx.array],
               totals: mx.array) -> tuple[mx.array, dict, list[mx.array], dict]:
        (loss, stats, policy_logprobs), grads = self._value_and_grad(self.policy.model, micro, ref, totals)
        return loss, stats, policy_logprobs, grads

    def _apply_update(self, grads: dict, scale: mx.array) -> mx.array:
        self.optimizer.update(self.policy.model, tree_map(lambda g: g * scale, grads))
        return scale

    def accumulate(self, micro_batches: list[MicroBatch], refs: list[Optional[mx.array]], totals: mx.array) -> Gradients:
        """Sum of the micro-batches' loss shares, stats and gradients (= the one-batch values)."""
        acc: Any = None
        per_token: list[mx.array] = []
        for micro, ref in zip(micro_batches, refs):
            compiled = None if self.compiled_update is None else self.compiled_update.grads(micro, ref, totals)
            loss, stats, token_values, grads = self._grads(micro, ref, totals) if compiled is None else compiled
            part = (loss, stats, grads)
            acc = part if acc is None else tree_map(mx.add, acc, part)
            # Evaluate per micro-batch: a lazy graph over all of them would hold every activation at once.
            mx.eval(acc)
            if token_values:  # the loss's own policy logprobs (one array), kept per micro-batch
                mx.eval(token_values)
                per_token.extend(token_values)
        loss, stats, grads = acc
        return Gradients(loss=loss, stats=stats, grads=grads, policy_logprobs=per_token)

    def gradients(self, batch: TrainBatch) -> Gradients:
        """The batch's gradients under the current weights, without applying them."""
        micro = split_batch(batch, self.micro_batch_tokens)
        return self.accumulate(micro, self.references(micro), batch_totals(batch))

    def apply(self, gradients: Gradients) -> tuple[float, Optional[str]]:
        """Clip to `grad_clip` and take one AdamW step, unless loss or norm is not finite.

        Returns (grad norm, skip reason). A skipped update touches neither the
        weights nor the optimizer state (its step count included).
        """
        norm = global_norm(gradients.grads)
        norm_value = scalar(norm)
        reason = skip_reason(scalar(gradients.loss), norm_value)
        if reason is not None:
            return norm_value, reason
        limit = self.optim_cfg.grad_clip
        # Same rule as optim.clip_grad_norm: rescale only when the norm exceeds the limit.
        scale = mx.where(norm < limit, mx.array(1.0), limit / (norm + 1e-6))
        update = self._apply_update if self.compiled_update is None else self.compiled_update.apply
        update(gradients.grads, scale)
        mx.eval(self.policy.model.trainable_parameters(), self.optimizer.state)
        return norm_value, None

    def references(self, micro_batches: list[MicroBatch]) -> list[Optional[mx.array]]:
        """pi_ref logprobs `[n, T]` per micro-batch (None each when beta = 0), evaluated one at a time."""
        return self.frozen.references(micro_batches)

    def step(self, batch: TrainBatch) -> StepStats:
        """Train on one batch: `ppo_epochs` accumulate-then-apply updates, stopping at a skipped one."""
        mx.reset_peak_memory()
        start = time.perf_counter()
        self.sharding.begin(batch)
        own = self.sharding.own_rows(batch)
        micro = split_batch(own, self.micro_batch_tokens)
        totals = batch_totals(batch)  # the whole batch's: every rank's share is normalised by the same totals
        refs = self.references(micro)
        ref_seconds = time.perf_counter() - start
        with_proximal = self.frozen.proximal(micro, checked=batch.check is not None)
        proximal_seconds = 0.0 if with_proximal is micro else time.perf_counter() - start - ref_seconds
        micro = with_proximal
        proximal = [m.proximal_logprobs for m in micro if m.proximal_logprobs is not None]
        check_started = time.perf_counter()  # older groups, recomputed at their versions before anything is applied
        rechecked, recomputed = check_older(self.policy.model, batch, own, self.sharding, temperature=self.temperature,
                                            micro_batch_tokens=self.micro_batch_tokens, chunk_tokens=self.chunk_tokens)
        sums: dict[str, float] = {}
        epochs, skipped, grid, checked, check_seconds = 0, None, None, [], time.perf_counter() - check_started
        while epochs < self.grpo.ppo_epochs and skipped is None:
            gradients = self.sharding.combine(self.accumulate(micro, refs, totals))
            if epochs == 0:
                # Only the first epoch's forward runs under the weights before the step: its logprobs are pi_prox,
                # and what an honest actor sampling those weights reported.
                grid = self.sharding.combine_proximal(batch, own, micro, proximal or gradients.policy_logprobs)
                check_started = time.perf_counter()
                checked = check_fused(batch, grid)
                check_seconds += time.perf_counter() - check_started
            broke = [c.broke for c in (*checked, *rechecked) if c.broke is not None]
            if broke:  # a lie, or a group to recompute, never trains: drop these gradients
                lie = any(b != "screen" for b in broke)
                grad_norm, skipped = float("nan"), LOGPROB_MISMATCH if lie else LOGPROB_SCREEN
            else:
                grad_norm, skipped = self.apply(gradients)
            epochs += 1
            values: dict[str, Any] = {"loss": gradients.loss, "grad_norm": grad_norm, **gradients.stats}
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        grid, offpolicy = offpolicy_summary(batch, grid, behaviour_correction(self.grpo))
        train_seconds = time.perf_counter() - start
        peak = int(mx.get_peak_memory())
        trim_cache(peak)
        means = {key: value / epochs for key, value in sums.items()}
        # The loss's statistics that StepStats names; one the loss leaves out stays None, not 0.0.
        known: dict[str, float] = {"loss": means.pop("loss"), "grad_norm": means.pop("grad_norm"),
                 **{name: means.pop(name) for name in ("kl", "clip_fraction", "policy_objective", "ratio_mean")
                    if name in means}}
        self.sharding.end(self.policy.model)
        return StepStats(**known, **offpolicy, ref_seconds=ref_seconds, proximal_seconds=proximal_seconds,
                         update_seconds=train_seconds - ref_seconds - proximal_seconds, train_seconds=train_seconds,
                         peak_memory_bytes=peak, micro_batches=len(micro), epochs=epochs,
                         learning_rate=float(self.optimizer.learning_rate.item()), skipped=skipped, extra=means,
                         proximal_logprobs=grid, checked=tuple(checked), rechecked=tuple(rechecked),
                         recomputed_rows=recomputed, check_seconds=slowest_check(self.sharding, batch, check_seconds))

    def save_optimizer(self, path: Path) -> None:
        """Optimizer moments and step, for an exact resume."""
        flat = dict(tree_flatten(self.optimizer.state))
        mx.save_safetensors(str(path), {k: v for k, v in flat.items() if isinstance(v, mx.array)})

    def load_optimizer(self, path: Path) -> None:
        """Restore what `save_optimizer` wrote."""
        loaded = cast(dict[str, Any], mx.load(str(path)))
        self.set_optimizer_state(tree_unflatten(list(loaded.items())))

    def set_optimizer_state(self, state: dict) -> None:
        """Replace the optimizer's moments and step (a checkpoint's, or rank 0's on the other ranks)."""
        self.optimizer.state = state
        mx.eval(self.optimizer.state)
        if self.compiled:
            # The compiled update captured the old state tree; trace again against the new one.
            self.compiled_update = self._compile()


def check_fused(batch: TrainBatch, grid: Optional[np.ndarray]) -> list[CheckedGroup]:
    """The fused logprob check of a checked batch against the step's own pi_prox `grid` (none unchecked)."""
    if batch.check is None:
        return []
    if grid is None:
        raise ValueError("TrainBatch.check found no policy logprobs to compare with (FrozenForwards.proximal makes them)")
    return fused_check(grid, np.array(batch.old_logprobs), np.array(batch.mask), batch.check)


def trainer_from_config(policy: Policy, cfg: RunConfig, ref_model: Optional[nn.Module] = None) -> Trainer:
    """The Trainer a run config describes (the loss grpo.loss names, objective, optimizer, memory settings)."""
    train = cfg.train
    return Trainer(
        policy, cfg.grpo, with_decay_steps(cfg), temperature=cfg.generation.temperature, max_tokens=cfg.generation.max_tokens,
        ref_model=ref_model, loss=loss_named(cfg.grpo.loss), compile=train.compile, micro_batch_tokens=train.micro_batch_tokens,
        logprob_chunk_tokens=train.logprob_chunk_tokens, grad_checkpoint=train.grad_checkpoint,
        attention_chunk_tokens=train.attention_chunk_tokens, native_exp=train.native_exp, numpy_exp=train.numpy_exp,
        memory_limit_bytes=train.memory_limit_bytes,
    )


def load_trainer(cfg: RunConfig, model_path: str,
                 before_reference: Callable[[Policy, bool], None] = lambda policy, reference_copy: None) -> Trainer:
    """The Trainer a run config describes, on the model at `model_path` loaded as the learner loads it (LoRA
    from the config; a frozen pi_ref copy when full fine-tuning with beta > 0).

    `before_reference(policy, reference_copy)` runs once the policy is loaded and before pi_ref is (the
    learner's memory check: it refuses a step this machine cannot hold before loading a second copy).
    """
    lora = cfg.lora if cfg.lora.enabled else None
    policy = load_policy(model_path, lora=lora, dtype=cfg.model.dtype)
    reference_copy = lora is None and cfg.grpo.beta > 0
    before_reference(policy, reference_copy)
    ref_model = None
    if reference_copy:
        # Full fine-tuning changes every weight, so pi_ref needs its own frozen copy.
        ref_model = load_policy(model_path, dtype=cfg.model.dtype).model
        ref_model.freeze()
    return trainer_from_config(policy, cfg, ref_model)
