"""The loss a `Trainer` differentiates: the default GRPO objective on one micro-batch, and pi_prox on the batch's grid.

The loss is a parameter of the trainer (`Loss`), so a new objective plugs in
without forking it; `GRPO_LOSS` (`default_loss`) wraps `grpo.grpo_loss`. The
config chooses it (grpo.loss, `loss_named`): a built-in one by name, or one of
the user's own as "package.module:NAME". A loss returns a declared record,
`LossOutput`: its share of the batch's loss, the statistics it computes (only
those), and the policy logprobs it saw, which the step's own logprob check
compares with what actors reported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from grpo_fleet.config import BUILT_IN_LOSSES, GRPOConfig
from grpo_fleet.learner.step.batch import MicroBatch, TrainBatch, unpack_completions
from grpo_fleet.learner.step.forward import completion_logprobs
from grpo_fleet.learner.step.grpo import BehaviourCorrection, grpo_loss
from grpo_fleet.learner.step.logprobs import head_logprobs
from grpo_fleet.learner.step.offpolicy import offpolicy_stats


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch."""

    loss: mx.array  # its share of the batch's loss: the shares of a batch's micro-batches sum to the batch's
    statistics: dict[str, mx.array] = field(default_factory=dict)  # scalars summed over micro-batches, as computed
    # The detached per-token logprobs `[n, T]` the loss saw (the first epoch's are pi_prox), or None: then a
    # checked step makes them with one no-grad forward of its own.
    policy_logprobs: Optional[mx.array] = None


class LossFn(Protocol):
    """A loss: this micro-batch's `LossOutput` under the model's current weights (pi_ref's logprobs when beta > 0,
    and the batch's token and sequence totals, for a batch-global normaliser)."""

    def __call__(self, model: nn.Module, micro: MicroBatch, ref_logprobs: Optional[mx.array], totals: mx.array, /,
                 *, grpo: GRPOConfig, temperature: float, max_tokens: int, chunk_tokens: int) -> LossOutput: ...


@dataclass(frozen=True)
class Loss:
    """A loss as the trainer takes it: the function, and whether its output carries the policy logprobs.

    Every loss gets the step's logprob check: one that gives no policy logprobs
    costs a checked step one no-grad forward for them (FrozenForwards.proximal).
    """

    name: str
    fn: LossFn
    gives_policy_logprobs: bool

    def check_cost(self) -> str:
        """Where the step's logprob check takes its policy logprobs from, and at what cost: the learner logs it."""
        if self.gives_policy_logprobs:
            return "the loss's own forward (a comparison, nothing more)"
        return "one no-grad forward more per checked step (the loss gives no policy logprobs of its own)"


def policy_logprobs(model: nn.Module, inputs: mx.array, targets: mx.array, temperature: float) -> mx.array:
    """Dense per-position logprobs `[N, L]` through the full `[N, L, V]` logits.

    The plain computation, kept for tests and the bench to compare against: the
    trainer itself never calls it.
    """
    return head_logprobs(model(inputs), targets, temperature)


def behaviour_correction(grpo: GRPOConfig) -> Optional[BehaviourCorrection]:
    """How the decoupled objective weights pi_prox / pi_behav; None for the coupled one, which weights nothing."""
    if grpo.objective != "decoupled":
        return None
    return BehaviourCorrection(cap=grpo.is_cap, mode=grpo.is_mode, level=grpo.is_level)


def default_loss(
    model: nn.Module, micro: MicroBatch, ref_logprobs: Optional[mx.array], totals: mx.array, /,
    *, grpo: GRPOConfig, temperature: float, max_tokens: int, chunk_tokens: int,
) -> LossOutput:
    """This micro-batch's share of the batch's GRPO objective under the current weights.

    Decoupled, pi_prox is `micro.proximal_logprobs` when the trainer made the extra
    forward (ppo_epochs > 1), else these very logprobs detached: before the first
    update the current weights are the proximal ones, so one epoch gets it free.
    """
    logprobs = completion_logprobs(model, micro, temperature=temperature, chunk_tokens=chunk_tokens)
    current = mx.stop_gradient(logprobs)
    correction = behaviour_correction(grpo)
    proximal = None
    if correction is not None:
        proximal = current if micro.proximal_logprobs is None else micro.proximal_logprobs
    low, high = grpo.clip_range
    loss, stats = grpo_loss(
        logprobs, micro.old_logprobs, micro.advantages, micro.mask,
        ref_logprobs=ref_logprobs, beta=grpo.beta, epsilon_low=low, epsilon_high=high,
        loss_type=grpo.loss_type, max_tokens=max_tokens, total_tokens=totals[0], total_sequences=totals[1],
        proximal_logprobs=proximal, correction=correction or BehaviourCorrection(), dual_clip=grpo.dual_clip,
    )
    return LossOutput(loss, stats, policy_logprobs=current)


GRPO_LOSS = Loss("grpo", default_loss, gives_policy_logprobs=True)
LOSSES = {loss.name: loss for loss in (GRPO_LOSS,)}  # config.BUILT_IN_LOSSES names these, for its validation


def loss_named(name: str) -> Loss:
    """The loss grpo.loss names: a built-in one (`LOSSES`), or "package.module:NAME", a `Loss` defined there."""
    if name in LOSSES:
        return LOSSES[name]
    module_name, _, attribute = name.partition(":")
    if not attribute:
        raise ValueError(f"unknown grpo.loss {name!r}: the built-in losses are {', '.join(BUILT_IN_LOSSES)}; a loss "
                         "of your own is named 'package.module:NAME'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"grpo.loss {name!r}: cannot import {module_name}: {exc}") from exc
    loss = getattr(module, attribute, None)
    if not isinstance(loss, Loss):
        raise ValueError(f"grpo.loss {name!r}: {module_name}.{attribute} is {type(loss).__name__}, not a Loss "
                         "(grpo_fleet.learner.step.objective.Loss)")
    return loss


def offpolicy_summary(
    batch: TrainBatch, grid: Optional[np.ndarray], correction: Optional[BehaviourCorrection],
) -> tuple[Optional[np.ndarray], dict[str, float]]:
    """The step's `offpolicy_stats` of pi_prox on the batch's `[N, L]` grid (none without a grid)."""
    if grid is None:
        return None, {}  # a loss that gives no policy logprobs, and no extra forward
    stats = offpolicy_stats(mx.array(grid), batch.old_logprobs, batch.mask, correction)
    return grid, {key: float(value) for key, value in stats.items()}


def proximal_grid(batch: TrainBatch, micro_batches: list[MicroBatch], proximal: list[mx.array]) -> Optional[np.ndarray]:
    """pi_prox per micro-batch scattered onto the batch's `[N, L]` grid; None without one per micro-batch."""
    if not micro_batches or len(proximal) != len(micro_batches):
        return None
    rows, width = batch.mask.shape
    return unpack_completions(micro_batches, proximal, (rows, width))
