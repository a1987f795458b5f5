"""Seeing what the model writes: a few decoded prompt / completion / reward rows of a step, for samples.jsonl.

Which completions: each trained group's best and worst (the contrast GRPO learns
from), group after group in the batch's order; then each group's next best and
next worst, and so on, until `train.log_samples_count` rows. Rewards are ranked
with a stable sort, so ties go in the order the actor sent them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import RunLog, SampleRow
from grpo_fleet.learner.step.advantages import group_advantages
from grpo_fleet.learner.step.length_shaping import NO_LENGTH_SHAPING, LengthShaping

Decode = Callable[[np.ndarray], str]


def samples_due(step: int, every: int) -> bool:
    """Whether `step` logs samples; `every` 0 means never."""
    return every > 0 and step % every == 0


def extremes_first(rewards: np.ndarray) -> list[int]:
    """Completion indices ordered best, worst, second best, second worst, ..."""
    ranked = [int(i) for i in np.argsort(-np.asarray(rewards, dtype=np.float64), kind="stable")]
    order: list[int] = []
    low, high = 0, len(ranked) - 1
    while low <= high:
        order.append(ranked[low])
        if high != low:
            order.append(ranked[high])
        low, high = low + 1, high - 1
    return order


def pick_samples(groups: Sequence[AcceptedGroup], count: int) -> list[tuple[int, int]]:
    """(group index, completion index) of the `count` completions to log, in the order they are logged."""
    orders = [extremes_first(group.rewards) for group in groups]
    picked: list[tuple[int, int]] = []
    for start in range(0, max((len(order) for order in orders), default=0), 2):
        for group_index, order in enumerate(orders):
            for completion_index in order[start : start + 2]:
                if len(picked) == count:
                    return picked
                picked.append((group_index, completion_index))
    return picked


def sample_rows(groups: Sequence[AcceptedGroup], picked: Sequence[tuple[int, int]], step: int, decode: Decode,
                *, scale_by_std: bool, lengths: LengthShaping = NO_LENGTH_SHAPING) -> list[SampleRow]:
    """The picked completions as rows, prompt and completion decoded, with the advantage the step gave them."""
    per_group: dict[int, tuple[str, np.ndarray]] = {}  # prompt text and advantages, once per group
    rows = []
    for group_index, completion_index in picked:
        group = groups[group_index]
        if group_index not in per_group:
            shaped = lengths.shaped_rewards(mx.array(group.rewards), np.array([int(c.sampled.sum()) for c in group.completions]))
            computed = group_advantages(shaped, len(group.completions), scale_by_std=scale_by_std)
            per_group[group_index] = (decode(group.prompt_tokens), np.array(computed))
        prompt, advantages = per_group[group_index]
        completion = group.completions[completion_index]
        rows.append(SampleRow(
            step=step, policy_version=group.policy_version, group_id=group.group_id, prompt_index=group.prompt_index,
            actor_id=group.actor_id, prompt=prompt, completion=decode(completion.tokens),
            reward=float(completion.reward), advantage=float(advantages[completion_index]),
            finish_reason=completion.finish_reason, num_tokens=len(completion.tokens),
            turns=episode_runs(completion.tokens, completion.mask, decode), end=completion.end,
        ))
    return rows


def episode_runs(tokens: np.ndarray, mask: Optional[np.ndarray], decode: Decode) -> list[list[str]]:
    """An episode's text run by run: each of the model's turns and each environment chunk, decoded apart."""
    if mask is None:
        return []
    edges = [0, *(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1).tolist(), len(tokens)]
    return [["model" if mask[a] else "environment", decode(tokens[a:b])] for a, b in zip(edges, edges[1:])]


def tokenizer_decode(tokenizer: Any) -> Decode:
    """Token ids -> text with the policy's own tokenizer, special tokens (the chat template, EOS) kept."""
    return lambda tokens: str(tokenizer.decode([int(t) for t in tokens]))


class SampleLog:
    """Writes a step's sample rows to samples.jsonl when `train.log_samples_every` says so."""

    def __init__(self, cfg: RunConfig, decode: Decode, runlog: RunLog) -> None:
        self.every, self.count = cfg.train.log_samples_every, cfg.train.log_samples_count
        self.scale_by_std, self.lengths = cfg.grpo.scales_by_std, LengthShaping.from_config(cfg)
        self.decode, self.runlog = decode, runlog

    def after_step(self, groups: Sequence[AcceptedGroup], step: int) -> int:
        """Log samples of the groups `step` trained on, if it is due; returns the rows written."""
        if not groups or not samples_due(step, self.every):
            return 0
        rows = sample_rows(groups, pick_samples(groups, self.count), step, self.decode, scale_by_std=self.scale_by_std,
                           lengths=self.lengths)
        self.runlog.samples(rows)
        return len(rows)
