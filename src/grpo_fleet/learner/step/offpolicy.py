"""How far the actors' pi_behav is from the learner's pi_prox, as pure functions: the step's off-policy stats.

Monitoring only: the loss's behaviour weights themselves are in grpo.py.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from grpo_fleet.learner.step.grpo import BehaviourCorrection, as_float, behaviour_weights, masked_mean


def log_gap(proximal_logprobs: mx.array, behaviour_logprobs: mx.array, mask: mx.array) -> mx.array:
    """|log pi_prox - log pi_behav| per token `[B, T]`, 0 off the mask: staleness and numerical mismatch together."""
    gap = mx.abs(as_float(proximal_logprobs) - as_float(behaviour_logprobs))
    return mx.stop_gradient(mx.where(mask != 0, gap, 0.0))


def offpolicy_stats(
    proximal_logprobs: mx.array,
    behaviour_logprobs: mx.array,
    mask: mx.array,
    correction: Optional[BehaviourCorrection],
) -> dict[str, mx.array]:
    """How far the batch's behaviour policy is from the proximal one, over its counted tokens.

    `offpolicy_gap_mean` / `offpolicy_gap_max`: mean and max of `log_gap`. The
    gap is taken absolute (as TRL's `sampling_logp_difference`): the signed mean
    is second order, E_behav[log(pi_prox / pi_behav)] = -KL(pi_behav || pi_prox).
    `is_capped_fraction`: share of tokens whose behaviour weight was truncated or
    masked; 0 without a correction (the coupled objective weights nothing).
    """
    m = mask.astype(mx.float32)
    gap = log_gap(proximal_logprobs, behaviour_logprobs, m)
    capped = mx.array(0.0)
    if correction is not None:
        capped = masked_mean(behaviour_weights(proximal_logprobs, behaviour_logprobs, m, correction)[1], m)
    return {"offpolicy_gap_mean": masked_mean(gap, m), "offpolicy_gap_max": mx.max(gap), "is_capped_fraction": capped}
