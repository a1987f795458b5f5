"""Checks on work the learner already holds: which accepted groups could have poisoned a step.

Plain data, no model. The door (`messages.validate_rollouts`) refuses values that
cannot be trained on; this is the second line of defence, used when a step's loss
or gradient still came out non-finite, to find whom to blame.
"""

from __future__ import annotations

import numpy as np

from grpo_fleet.learner.batch import AcceptedGroup
from grpo_fleet.protocol.messages import values_out_of_bounds


def suspect_groups(groups: list[AcceptedGroup], reward_bound: float) -> dict[str, str]:
    """group_id -> reason for every group holding a value out of its float32 bounds."""
    suspects: dict[str, str] = {}
    for group in groups:
        # In float32, as trained: a reward of 1e39 is inf here.
        logprobs = np.concatenate([c.logprobs.astype(np.float32) for c in group.completions])
        with np.errstate(over="ignore", invalid="ignore"):  # overflowing is what we look for
            reason = values_out_of_bounds(logprobs, group.rewards, reward_bound)
        if reason is not None:
            suspects[group.group_id] = reason
    return suspects
