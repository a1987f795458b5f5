"""What a completion's length does to its training signal, as one record the batch builder (batch.py) applies.

Kept apart from the packing: the rule is the run's config, read once, and the rewards it shapes are the ones the
advantages are computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.step.advantages import overlong_penalty


@dataclass(frozen=True)
class LengthShaping:
    """What a completion's length does to its training signal (DAPO's two remedies for overlong ones).

    `mask_truncated`: completions cut off at `max_tokens` get zero loss weight (their
    mask rows are zeroed), while their rewards still enter the group's mean and std.
    `overlong_buffer` > 0: `grpo.overlong_penalty` is added to each reward before the
    advantages, ramping from 0 to -overlong_penalty over the last `overlong_buffer`
    tokens before `max_tokens`.

    Episodes (task.env) are shaped per episode: one cut off by task.max_episode_tokens
    (end "budget") is the truncated one, and its length is the tokens the model
    sampled, against task.max_episode_tokens.
    """

    max_tokens: int = 0
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "LengthShaping":
        grpo = cfg.grpo
        max_tokens = cfg.task.max_episode_tokens if cfg.task.env else cfg.generation.max_tokens
        return cls(max_tokens=max_tokens, mask_truncated=grpo.mask_truncated,
                   overlong_buffer=grpo.overlong_buffer, overlong_penalty=grpo.overlong_penalty)

    def shaped_rewards(self, rewards: mx.array, lengths: np.ndarray) -> mx.array:
        if self.overlong_buffer == 0:
            return rewards
        penalty = overlong_penalty(mx.array(lengths), self.max_tokens, self.overlong_buffer, self.overlong_penalty)
        return rewards + penalty


NO_LENGTH_SHAPING = LengthShaping()
