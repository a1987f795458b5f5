"""The no-grad forwards a step makes before its update: pi_ref, and pi_prox where the loss needs one of its own.

Kept apart from the update (trainer.py): these read the weights and never change them, and each decides alone
whether it is needed at all (beta = 0 needs no pi_ref; one coupled epoch needs no pi_prox).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.config import GRPOConfig
from grpo_fleet.learner.step.batch import MicroBatch
from grpo_fleet.learner.step.forward import frozen_logprobs
from grpo_fleet.models.loading import Policy, adapters_disabled


class FrozenForwards:
    """pi_ref logprobs per micro-batch (the base with adapters off under LoRA, else a frozen copy), and the
    micro-batches with pi_prox attached when the step must make it first."""

    def __init__(self, policy: Policy, grpo: GRPOConfig, ref_model: Optional[nn.Module], *, temperature: float,
                 chunk_tokens: int, loss_returns_logprobs: bool) -> None:
        self.policy, self.grpo, self.ref_model = policy, grpo, ref_model
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.loss_returns_logprobs = loss_returns_logprobs

    def _reference_context(self) -> tuple[nn.Module, contextlib.AbstractContextManager]:
        """pi_ref: the base with adapters off under LoRA, a frozen copy otherwise."""
        if self.policy.lora is not None:
            return self.policy.model, adapters_disabled(self.policy.model)
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        raise ValueError("beta > 0 with full fine-tuning needs a reference model")

    def references(self, micro_batches: list[MicroBatch]) -> list[Optional[mx.array]]:
        """pi_ref logprobs `[n, T]` per micro-batch (None each when beta = 0), evaluated one at a time."""
        if self.grpo.beta == 0:
            return [None] * len(micro_batches)
        model, context = self._reference_context()
        with context:
            return [*frozen_logprobs(model, micro_batches, temperature=self.temperature, chunk_tokens=self.chunk_tokens)]

    def proximal(self, micro_batches: list[MicroBatch], checked: bool) -> list[MicroBatch]:
        """The micro-batches with pi_prox attached, where the step needs a forward of its own for it.

        Decoupled at ppo_epochs > 1 the weights move after the first epoch, so
        pi_prox (the weights before the step) is one no-grad forward per
        micro-batch, made first. So is it for a `checked` batch (`TrainBatch.check`)
        when the loss gives no policy logprobs of its own (Loss.gives_policy_logprobs): the logprob
        check and screen compare against it. Otherwise they come back as they are:
        with one epoch the loss takes pi_prox from its own forward, and coupled needs none.
        """
        decoupled = self.grpo.objective == "decoupled" and self.grpo.ppo_epochs > 1
        if not decoupled and not (checked and not self.loss_returns_logprobs):
            return micro_batches
        logprobs = frozen_logprobs(self.policy.model, micro_batches, temperature=self.temperature,
                                   chunk_tokens=self.chunk_tokens)
        return [replace(micro, proximal_logprobs=lp) for micro, lp in zip(micro_batches, logprobs)]
