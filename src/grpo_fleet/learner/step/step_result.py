"""What a step hands on: the gradients summed over its micro-batches, and what the step did."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.learner.step.fused_check import CheckedGroup
from grpo_fleet.learner.step.update_stats import UpdateStats
from grpo_fleet.runtime.trees import flat_leaves

# StepStats.skipped when the step's own check found a lie: the gradients were dropped, not applied.
LOGPROB_MISMATCH = "logprob_mismatch"
# An older group broke the step's screen: nothing applied; it is recomputed at its version, and the batch taken again.
LOGPROB_SCREEN = "logprob_screen"


@dataclass
class Gradients:
    """Loss, stats and gradients summed over a batch's micro-batches; not yet applied."""

    loss: mx.array
    stats: dict[str, mx.array]
    grads: dict
    policy_logprobs: list[mx.array] = field(default_factory=list)  # LossOutput.policy_logprobs per micro-batch, if any


@dataclass(frozen=True, kw_only=True)
class StepStats(UpdateStats):
    """What one `Trainer.step` did; loss and stats are means over the epochs that ran."""

    policy_objective: Optional[float] = None  # the loss's statistic (None: it computes none)
    ref_seconds: float
    update_seconds: float
    train_seconds: float
    micro_batches: int
    epochs: int  # epochs attempted, the skipped one included
    extra: dict[str, float] = field(default_factory=dict)  # statistics the loss computes beyond these
    proximal_seconds: float = 0.0  # the no-grad pi_prox forward (decoupled at ppo_epochs > 1, or a checked step's
    # under a loss that gives no policy logprobs: FrozenForwards.proximal); else 0
    # pi_prox at the batch's completion positions, [N, L] like TrainBatch.old_logprobs (0 elsewhere), for
    # comparing what the learner computes with what each actor reported; None if the loss gave none and no forward made them.
    proximal_logprobs: Optional[np.ndarray] = field(default=None, repr=False)
    # The groups the step checked or screened against its own first forward (TrainBatch.check), with their gaps;
    # when one broke its bound, `skipped` is LOGPROB_MISMATCH (or LOGPROB_SCREEN) and nothing was applied.
    checked: tuple[CheckedGroup, ...] = ()
    # The older groups recomputed at their versions inside the step (TrainBatch.recheck), judged on every rank's rows.
    rechecked: tuple[CheckedGroup, ...] = ()
    recomputed_rows: int = 0  # of them, by this rank
    check_seconds: float = 0.0  # the checks' seconds on the slowest rank: the recomputing and the comparisons


def global_norm(grads: dict) -> mx.array:
    """L2 norm over every gradient, in fp32 so half-precision squares cannot overflow."""
    leaves = [g.astype(mx.float32) for _, g in flat_leaves(grads)]
    return mx.sqrt(sum((mx.sum(g * g) for g in leaves), mx.array(0.0)))


def skip_reason(loss: float, norm: float) -> Optional[str]:
    """Why an update must be skipped (a non-finite loss or gradient norm), or None."""
    if not math.isfinite(loss):
        return "nonfinite_loss"
    if not math.isfinite(norm):
        return "nonfinite_grad"
    return None
