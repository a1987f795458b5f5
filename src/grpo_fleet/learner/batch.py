"""Turn accepted groups into the padded arrays one GRPO step consumes.

Plain data in, plain arrays out: no sockets, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from grpo_fleet.learner.grpo import group_advantages

# Sequence lengths are rounded up to a multiple of this, so shapes repeat and
# compiled or cached kernels are reused instead of rebuilt for every length.
LENGTH_BUCKET = 16


@dataclass
class CompletionRecord:
    """One completion as accepted from an actor."""

    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], under pi_old
    reward: float
    finish_reason: str


@dataclass
class AcceptedGroup:
    """A validated group of G completions of one prompt."""

    group_id: str
    prompt_index: int
    prompt_tokens: np.ndarray  # int32 [P]
    completions: list[CompletionRecord]
    policy_version: int
    actor_id: str
    actor_key: str = ""  # the peer key its violations and bans are counted under

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], dtype=np.float32)

    @property
    def is_informative(self) -> bool:
        """False when every completion got the same reward, so every advantage is 0."""
        rewards = self.rewards
        return bool(rewards.max() != rewards.min())

    @property
    def num_tokens(self) -> int:
        return int(sum(len(c.tokens) for c in self.completions))


@dataclass
class TrainBatch:
    """Right-padded [N, L] arrays for N = groups * G sequences."""

    inputs: mx.array  # int32: prompt + completion, minus the last token
    targets: mx.array  # int32: inputs shifted by one
    mask: mx.array  # float32: 1 where the target is a completion token
    old_logprobs: mx.array  # float32: pi_old logprob at completion targets, 0 elsewhere
    advantages: mx.array  # float32 [N]
    rewards: mx.array  # float32 [N]
    num_groups: int


def _bucketed(length: int) -> int:
    return max(LENGTH_BUCKET, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET)


def build_train_batch(groups: list[AcceptedGroup], *, scale_by_std: bool = True) -> TrainBatch:
    """Pack groups into shifted, masked arrays and compute group-relative advantages."""
    if not groups:
        raise ValueError("cannot build a batch from no groups")
    group_size = len(groups[0].completions)
    if any(len(g.completions) != group_size for g in groups):
        raise ValueError("every group in a batch must have the same size")
    rows = [(g.prompt_tokens, c) for g in groups for c in g.completions]
    width = _bucketed(max(len(p) + len(c.tokens) - 1 for p, c in rows))
    inputs = np.zeros((len(rows), width), dtype=np.int32)
    targets = np.zeros_like(inputs)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    old = np.zeros_like(mask)
    for row, (prompt, completion) in enumerate(rows):
        sequence = np.concatenate([prompt, completion.tokens]).astype(np.int32)
        length = len(sequence) - 1
        inputs[row, :length] = sequence[:-1]
        targets[row, :length] = sequence[1:]
        start = len(prompt) - 1  # first position whose target is a completion token
        mask[row, start:length] = 1.0
        old[row, start:length] = completion.logprobs
    rewards = mx.array(np.concatenate([g.rewards for g in groups]))
    advantages = group_advantages(rewards, group_size, scale_by_std=scale_by_std)
    return TrainBatch(
        inputs=mx.array(inputs),
        targets=mx.array(targets),
        mask=mx.array(mask),
        old_logprobs=mx.array(old),
        advantages=advantages,
        rewards=rewards,
        num_groups=len(groups),
    )
