"""Turn accepted groups into the padded arrays one GRPO step consumes, and split
those into token-budgeted, length-grouped micro-batches.

Plain data in, plain arrays out: no sockets, no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np

from grpo_fleet.learner.step.advantages import group_advantages
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.length_shaping import NO_LENGTH_SHAPING, LengthShaping

# Sequence lengths are rounded up to a multiple of this, so shapes repeat and
# compiled or cached kernels are reused instead of rebuilt for every length.
LENGTH_BUCKET = 16
# What one more micro-batch costs, in padded positions: the planner splits rows of different lengths apart only when
# that saves more padding than this (a call of the compiled step, a partly filled LM-head chunk, a gradient sum, a
# compiled trace per new shape). A judgement, not a measurement: at 64 completions spread 16..512 are cut into 13-16
# micro-batches of 4,096 tokens (1.04x padded) where filling each to the budget made 6-7 (1.11-1.16x); at 0 it
# would be one per row (1.02x), at 256 7-8 (1.06-1.09x).
MICRO_BATCH_COST_TOKENS = 64


class ScoredCompletion(Protocol):
    """What a batch needs of one completion (learner/records/groups.py's CompletionRecord is one)."""

    @property
    def tokens(self) -> np.ndarray: ...  # int32 [T]

    @property
    def logprobs(self) -> np.ndarray: ...  # float32 [T], under pi_behav

    @property
    def truncated(self) -> bool: ...

    @property
    def sampled(self) -> np.ndarray: ...  # bool [T]: sampled by the model (an episode's environment tokens: False)


class ScoredGroup(Protocol):
    """What a batch needs of one group: the step knows no learner record (learner/records/groups.py's
    AcceptedGroup is one), so it sits at the bottom of the learner's floors."""

    @property
    def prompt_tokens(self) -> np.ndarray: ...  # int32 [P]

    @property
    def completions(self) -> Sequence[ScoredCompletion]: ...

    @property
    def rewards(self) -> np.ndarray: ...  # float32 [G]


@dataclass
class TrainBatch:
    """Right-padded [N, L] arrays for N = groups * G sequences."""

    inputs: mx.array  # int32: prompt + completion, minus the last token
    targets: mx.array  # int32: inputs shifted by one
    mask: mx.array  # float32: 1 where the target is a sampled completion token the loss counts (0 at an
    # episode's environment tokens: the loss, KL, normalisers, gaps and logprob checks all read only this)
    old_logprobs: mx.array  # float32: pi_behav logprob at completion targets, 0 elsewhere
    advantages: mx.array  # float32 [N]
    rewards: mx.array  # float32 [N], the task's (before any length shaping)
    num_groups: int
    # float32 [groups, 2]: (mean, token) logprob-gap bounds of the groups the step itself checks against its own
    # first forward (learner/step/fused_check.py); +inf rows are not checked there. None: no group is.
    check: Optional[np.ndarray] = None
    # Older groups recomputed at their own versions inside the step, each rank its own rows (data parallelism
    # under LoRA; learner/step/recheck.py). None: none is.
    recheck: Optional[Recheck] = None


def _bucketed(length: int) -> int:
    return max(LENGTH_BUCKET, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET)


def build_train_batch(
    groups: Sequence[ScoredGroup], *, scale_by_std: bool = True, lengths: LengthShaping = NO_LENGTH_SHAPING
) -> TrainBatch:
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
        sampled = completion.sampled
        mask[row, start:length] = 0.0 if lengths.mask_truncated and completion.truncated else sampled
        old[row, start:length] = np.where(sampled, completion.logprobs, 0.0)
    rewards = mx.array(np.concatenate([g.rewards for g in groups]))
    shaped = lengths.shaped_rewards(rewards, np.array([int(c.sampled.sum()) for _, c in rows]))
    advantages = group_advantages(shaped, group_size, scale_by_std=scale_by_std)
    return TrainBatch(
        inputs=mx.array(inputs),
        targets=mx.array(targets),
        mask=mx.array(mask),
        old_logprobs=mx.array(old),
        advantages=advantages,
        rewards=rewards,
        num_groups=len(groups),
    )


@dataclass
class MicroBatch:
    """Some rows of a TrainBatch, with their completion positions packed flat.

    The model body runs on `inputs`; the LM head runs only at `positions` (flat
    indices `row * W + column` into `inputs`), never at prompt or padding
    positions. `layout` maps those `[K]` packed logprobs back to one row per
    completion, `[n, T]`, the shape the loss takes.
    """

    inputs: mx.array  # int32 [n, W]
    positions: mx.array  # int32 [K]; K is bucketed for shape reuse, and its few padding slots point at position 0, never read
    targets: mx.array  # int32 [K]: the completion token at each position
    layout: mx.array  # int32 [n, T]: index into [K]; masked slots point at 0
    mask: mx.array  # float32 [n, T]: 1 for a real completion token
    old_logprobs: mx.array  # float32 [n, T]: pi_behav
    advantages: mx.array  # float32 [n]
    # float32 [n, T]: pi_prox, the weights before the step's first update, set by the trainer's extra
    # no-grad forward when it needs one (decoupled objective, ppo_epochs > 1); None otherwise.
    proximal_logprobs: Optional[mx.array] = None
    rows: Optional[np.ndarray] = None  # [n]: the TrainBatch rows, to scatter results back
    columns: Optional[np.ndarray] = None  # [n, T]: each slot's column in the TrainBatch

    @property
    def padded_tokens(self) -> int:
        return int(self.inputs.shape[0] * self.inputs.shape[1])


def row_lengths(mask: np.ndarray) -> np.ndarray:
    """Positions each row needs: up to its last completion target (at least 1)."""
    on = mask != 0
    last = np.where(on.any(axis=1), on.shape[1] - np.argmax(on[:, ::-1], axis=1), 1)
    return last.astype(np.int64)


def plan_micro_batches(lengths: Sequence[int] | np.ndarray, token_budget: int) -> list[list[int]]:
    """Group row indices so each group's rows x bucketed width stays within `token_budget`, padding least.

    Rows go longest first, so a group's width is set by its first row. Where the
    groups are cut is chosen to minimise the padded positions plus
    MICRO_BATCH_COST_TOKENS for each group (a shortest-path over the sorted rows):
    filling each group greedily to the budget put rows of 16 and 500 tokens side
    by side (1.11-1.16x padded over real positions for lengths spread 16..512 at
    4,096 tokens; this plan 1.04x). A row longer than the budget gets a group of
    its own rather than being refused.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    widths = [_bucketed(int(lengths[i])) for i in order]
    cut = _cheapest_cuts(widths, token_budget)
    plans: list[list[int]] = []
    end = len(order)
    while end > 0:
        plans.append(order[cut[end] : end])
        end = cut[end]
    return plans[::-1]


def _cheapest_cuts(widths: list[int], token_budget: int) -> list[int]:
    """Over rows sorted widest first: where the last group of the cheapest plan of the first i rows starts.

    A group of rows j..i-1 costs (i - j) * widths[j] + MICRO_BATCH_COST_TOKENS and
    fits when (i - j) * widths[j] <= token_budget, or holds one row. Earlier starts
    only grow a group and widen it, so the inner loop stops at the first that does
    not fit: at most token_budget / LENGTH_BUCKET steps a row.
    """
    cost = [0] * (len(widths) + 1)
    cut = [0] * (len(widths) + 1)
    for end in range(1, len(widths) + 1):
        start = end - 1
        cost[end], cut[end] = cost[start] + widths[start] + MICRO_BATCH_COST_TOKENS, start
        while start > 0 and (end - start + 1) * widths[start - 1] <= token_budget:
            start -= 1
            total = cost[start] + (end - start) * widths[start] + MICRO_BATCH_COST_TOKENS
            if total < cost[end]:
                cost[end], cut[end] = total, start
    return cut


def _packed(rows: list[int], mask: np.ndarray, targets: np.ndarray, old: np.ndarray, width: int) -> dict[str, np.ndarray]:
    """Flat completion positions of `rows` and the [n, T] layout that indexes them."""
    cols = [np.flatnonzero(mask[r]) for r in rows]
    total = sum(len(c) for c in cols)
    slots = _bucketed(max(len(c) for c in cols))
    out: dict[str, np.ndarray] = {
        "positions": np.zeros(_bucketed(total), np.int32), "targets": np.zeros(_bucketed(total), np.int32),
        "layout": np.zeros((len(rows), slots), np.int32), "columns": np.zeros((len(rows), slots), np.int64),
        "mask": np.zeros((len(rows), slots), np.float32), "old": np.zeros((len(rows), slots), np.float32),
    }
    offset = 0
    for j, (row, col) in enumerate(zip(rows, cols)):
        count = len(col)
        out["positions"][offset : offset + count] = j * width + col
        out["targets"][offset : offset + count] = targets[row, col]
        out["layout"][j, :count] = offset + np.arange(count)
        out["columns"][j, :count] = col
        out["mask"][j, :count] = 1.0
        out["old"][j, :count] = old[row, col]
        offset += count
    return out


def split_batch(batch: TrainBatch, token_budget: int) -> list[MicroBatch]:
    """The batch as length-grouped micro-batches of at most `token_budget` padded tokens."""
    inputs, targets = np.array(batch.inputs), np.array(batch.targets)
    mask, old = np.array(batch.mask), np.array(batch.old_logprobs)
    advantages = np.array(batch.advantages)
    lengths = row_lengths(mask)
    micro: list[MicroBatch] = []
    for rows in plan_micro_batches(lengths, token_budget):
        width = min(_bucketed(int(lengths[rows[0]])), inputs.shape[1])
        packed = _packed(rows, mask, targets, old, width)
        micro.append(MicroBatch(
            inputs=mx.array(inputs[rows, :width]), positions=mx.array(packed["positions"]),
            targets=mx.array(packed["targets"]), layout=mx.array(packed["layout"]), mask=mx.array(packed["mask"]),
            old_logprobs=mx.array(packed["old"]), advantages=mx.array(advantages[rows]),
            rows=np.asarray(rows), columns=packed["columns"],
        ))
    return micro


def take_rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    """The sub-batch of `rows` (same width), with their part of the recheck; `num_groups` stays the whole batch's."""
    index = mx.array(rows.astype(np.int32))
    return TrainBatch(
        inputs=batch.inputs[index], targets=batch.targets[index], mask=batch.mask[index],
        old_logprobs=batch.old_logprobs[index], advantages=batch.advantages[index], rewards=batch.rewards[index],
        num_groups=batch.num_groups, recheck=None if batch.recheck is None else batch.recheck.of_rows(rows),
    )


def batch_totals(batch: TrainBatch) -> mx.array:
    """[completion tokens, sequences] of the whole batch: the loss's global normaliser."""
    tokens = mx.sum(batch.mask).astype(mx.float32)
    return mx.stack([tokens, mx.array(float(batch.mask.shape[0]), dtype=mx.float32)])


def unpack_completions(micro_batches: list[MicroBatch], values: list[mx.array], shape: tuple[int, int]) -> np.ndarray:
    """Scatter per-micro-batch `[n, T]` values back to the TrainBatch's `[N, L]` grid (0 elsewhere)."""
    out = np.zeros(shape, dtype=np.float32)
    for micro, value in zip(micro_batches, values):
        assert micro.rows is not None and micro.columns is not None
        on = np.array(micro.mask) != 0
        rows = np.broadcast_to(micro.rows[:, None], on.shape)
        out[rows[on], micro.columns[on]] = np.array(value)[on]
    return out
