"""What a step hands on: the gradients summed over its micro-batches, and what the step did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np


@dataclass
class Gradients:
    """Loss, stats and gradients summed over a batch's micro-batches; not yet applied."""

    loss: mx.array
    stats: dict[str, mx.array]
    grads: dict
    policy_logprobs: list[mx.array] = field(default_factory=list)  # POLICY_LOGPROBS per micro-batch, if any


@dataclass
class StepStats:
    """What one `Trainer.step` did; loss and stats are means over the epochs that ran."""

    loss: float
    kl: float
    clip_fraction: float
    grad_norm: float
    policy_objective: float
    ratio_mean: float  # pi_theta / pi_behav coupled, pi_theta / pi_prox decoupled (1 at ppo_epochs = 1)
    ref_seconds: float
    update_seconds: float
    train_seconds: float
    peak_memory_bytes: int
    micro_batches: int
    epochs: int  # epochs attempted, the skipped one included
    learning_rate: float = 0.0  # the rate of this step's last applied update (the schedule's value)
    skipped: Optional[str] = None  # "nonfinite_loss" or "nonfinite_grad": that epoch applied no update
    extra: dict[str, float] = field(default_factory=dict)  # stats a custom loss_fn adds
    proximal_seconds: float = 0.0  # the no-grad pi_prox forward (decoupled, ppo_epochs > 1); else 0
    # offpolicy.offpolicy_stats of pi_prox (the weights before this step) against the actors' pi_behav.
    offpolicy_gap_mean: float = 0.0
    offpolicy_gap_max: float = 0.0
    is_capped_fraction: float = 0.0
    # pi_prox at the batch's completion positions, [N, L] like TrainBatch.old_logprobs (0 elsewhere), for
    # comparing what the learner computes with what each actor reported; None if the loss_fn returned none.
    proximal_logprobs: Optional[np.ndarray] = field(default=None, repr=False)
