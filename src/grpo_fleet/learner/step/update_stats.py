"""The stats of one update that a step hands on and metrics.jsonl keeps: declared once, here.

Plain dataclasses, no MLX, so the readers of metrics.jsonl can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional


@dataclass(frozen=True, kw_only=True)
class UpdateStats:
    """What a step's update did, as `StepStats` hands it on and its metrics.jsonl line (`StepRecord`) keeps it.

    Both extend this record, so a new stat of the update is declared here, once.
    """

    loss: float
    grad_norm: float
    # The loss's own statistics: None when the loss computes none such (a custom loss), never a made-up 0.
    kl: Optional[float] = None
    clip_fraction: Optional[float] = None
    # Mean importance ratio over the step's tokens: pi_theta / pi_behav (coupled) or pi_theta / pi_prox
    # (decoupled; 1 at ppo_epochs = 1).
    ratio_mean: Optional[float] = None
    # offpolicy.offpolicy_stats of pi_prox (the weights before this step) against the actors' pi_behav:
    # |log pi_prox - log pi_behav| over the step's tokens (staleness and numerical mismatch together), and the
    # share of tokens whose behaviour weight grpo.is_cap truncated or masked (0 under the coupled objective).
    offpolicy_gap_mean: float = 0.0
    offpolicy_gap_max: float = 0.0
    is_capped_fraction: float = 0.0
    learning_rate: float = 0.0  # the rate of this step's last applied update (optim.schedule's value)
    # "nonfinite_loss" or "nonfinite_grad": that epoch applied no update; "logprob_mismatch": the step's own check
    # found a group beyond its bound before anything was applied (step_result.LOGPROB_MISMATCH)
    skipped: Optional[str] = None
    peak_memory_bytes: int

    def update_stats(self) -> dict[str, Any]:
        """The `UpdateStats` fields of this record (of a `StepStats`: what its `StepRecord` copies)."""
        return {f.name: getattr(self, f.name) for f in fields(UpdateStats)}
