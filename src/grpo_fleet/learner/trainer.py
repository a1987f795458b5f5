"""The MLX update: forward the policy (and pi_ref), GRPO loss, clipped AdamW step.

The loss is a parameter (`loss_fn`) so a new objective plugs in without forking
the trainer; the default wraps `grpo.grpo_loss`.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.config import GRPOConfig, OptimConfig
from grpo_fleet.learner.batch import TrainBatch
from grpo_fleet.learner.grpo import grpo_loss, token_logprobs
from grpo_fleet.model import Policy, adapters_disabled


def policy_logprobs(model: nn.Module, inputs: mx.array, targets: mx.array, temperature: float) -> mx.array:
    """Per-token logprobs under the same convention the actors record: log_softmax(logits / T)."""
    logits = model(inputs).astype(mx.float32)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, targets)


def default_loss(
    model: nn.Module, batch: TrainBatch, ref_logprobs: Optional[mx.array], *, grpo: GRPOConfig, temperature: float, max_tokens: int
) -> tuple[mx.array, dict]:
    """GRPO objective of `batch` under the current weights."""
    logprobs = policy_logprobs(model, batch.inputs, batch.targets, temperature)
    return grpo_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        ref_logprobs=ref_logprobs,
        beta=grpo.beta,
        epsilon_low=grpo.epsilon_low,
        epsilon_high=grpo.epsilon_high,
        loss_type=grpo.loss_type,
        max_tokens=max_tokens,
    )


class Trainer:
    """Owns the optimizer and takes `ppo_epochs` clipped AdamW steps per batch."""

    def __init__(
        self,
        policy: Policy,
        grpo: GRPOConfig,
        optim_cfg: OptimConfig,
        *,
        temperature: float,
        max_tokens: int,
        ref_model: Optional[nn.Module] = None,
        loss_fn: Optional[Callable[..., tuple[mx.array, dict]]] = None,
        compile: bool = False,
    ) -> None:
        self.policy = policy
        self.grpo = grpo
        self.optim_cfg = optim_cfg
        self.temperature = temperature
        self.ref_model = ref_model
        loss = loss_fn or default_loss
        bound = partial(loss, grpo=grpo, temperature=temperature, max_tokens=max_tokens)
        self._loss_and_grad = nn.value_and_grad(policy.model, bound)
        self.optimizer = optim.AdamW(
            learning_rate=optim_cfg.lr, betas=list(optim_cfg.betas), weight_decay=optim_cfg.weight_decay
        )
        self.optimizer.init(policy.model.trainable_parameters())
        # Materialize now: lazy arrays belong to the creating thread's stream, and
        # the learner trains on its own thread.
        mx.eval(self.optimizer.state)
        self.compiled = compile
        self._compiled_updates = self._compile_updates() if compile else {}

    def _update(self, batch: TrainBatch, ref: Optional[mx.array]) -> tuple[mx.array, dict, mx.array]:
        """Loss, gradients, global-norm clipping and one AdamW step."""
        (loss, stats), grads = self._loss_and_grad(self.policy.model, batch, ref)
        grads, grad_norm = optim.clip_grad_norm(grads, self.optim_cfg.grad_clip)
        self.optimizer.update(self.policy.model, grads)
        return loss, stats, grad_norm

    def _compile_updates(self) -> dict[bool, Callable]:
        """`_update` under mx.compile, one variant with pi_ref and one without.

        Model, optimizer and RNG state are declared as inputs and outputs so the
        compiled graph updates them in place. The reference forward stays outside:
        it toggles the LoRA scale, which a compiled graph would freeze.
        """
        state = [self.policy.model.state, self.optimizer.state, mx.random.state]

        def with_ref(inputs, targets, mask, old, advantages, rewards, ref):
            return self._update(TrainBatch(inputs, targets, mask, old, advantages, rewards, 0), ref)

        def without_ref(inputs, targets, mask, old, advantages, rewards):
            return self._update(TrainBatch(inputs, targets, mask, old, advantages, rewards, 0), None)

        return {True: mx.compile(with_ref, inputs=state, outputs=state),
                False: mx.compile(without_ref, inputs=state, outputs=state)}

    def _run_update(self, batch: TrainBatch, ref: Optional[mx.array]) -> tuple[mx.array, dict, mx.array]:
        if not self.compiled:
            return self._update(batch, ref)
        arrays = (batch.inputs, batch.targets, batch.mask, batch.old_logprobs, batch.advantages, batch.rewards)
        if ref is None:
            return self._compiled_updates[False](*arrays)
        return self._compiled_updates[True](*arrays, ref)

    def reference_logprobs(self, batch: TrainBatch) -> Optional[mx.array]:
        """pi_ref logprobs: the base with adapters off under LoRA, a frozen copy otherwise."""
        if self.grpo.beta == 0:
            return None
        if self.policy.lora is not None:
            with adapters_disabled(self.policy.model):
                ref = policy_logprobs(self.policy.model, batch.inputs, batch.targets, self.temperature)
        elif self.ref_model is not None:
            ref = policy_logprobs(self.ref_model, batch.inputs, batch.targets, self.temperature)
        else:
            raise ValueError("beta > 0 with full fine-tuning needs a reference model")
        ref = mx.stop_gradient(ref)
        mx.eval(ref)
        return ref

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on one batch; returns scalar stats averaged over the epochs."""
        start = time.perf_counter()
        ref = self.reference_logprobs(batch)
        totals: dict[str, float] = {"ref_seconds": time.perf_counter() - start}
        for _ in range(self.grpo.ppo_epochs):
            loss, stats, grad_norm = self._run_update(batch, ref)
            mx.eval(self.policy.model.trainable_parameters(), self.optimizer.state, loss, stats, grad_norm)
            for key, value in {"loss": loss, "grad_norm": grad_norm, **stats}.items():
                totals[key] = totals.get(key, 0.0) + float(value) / self.grpo.ppo_epochs
        totals["train_seconds"] = time.perf_counter() - start
        totals["update_seconds"] = totals["train_seconds"] - totals["ref_seconds"]
        return totals

    def save_optimizer(self, path: Path) -> None:
        """Optimizer moments and step, for an exact resume."""
        flat = dict(tree_flatten(self.optimizer.state))
        mx.save_safetensors(str(path), {k: v for k, v in flat.items() if isinstance(v, mx.array)})

    def load_optimizer(self, path: Path) -> None:
        """Restore what `save_optimizer` wrote."""
        loaded: dict[str, Any] = dict(mx.load(str(path)))
        self.optimizer.state = tree_unflatten(list(loaded.items()))
        mx.eval(self.optimizer.state)
        if self.compiled:
            # The compiled update captured the old state tree; trace again against the new one.
            self._compiled_updates = self._compile_updates()
