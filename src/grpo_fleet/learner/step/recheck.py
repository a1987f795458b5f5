"""The logprob check of older groups inside a data-parallel step: each rank recomputes its own rows of them.

A group sampled at a version older than the one the step trains from cannot be
judged against the step's own forward (fused_check.py): its logprobs must be
recomputed under its own version's weights. With several ranks each rank
recomputes the rows of those groups that it trains, under the weights rank 0
sent with the batch (`TrainBatch.recheck`), before anything is applied. The
rows are summed into the batch's `[N, L]` grid, so every rank judges the same
groups the same way, and a lie drops the step's gradients on every rank, as a
fused-check lie does. Only the rows rank 0 picked are recomputed
(security.check_completions).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from grpo_fleet.learner.step.batch import TrainBatch, split_batch, take_rows, unpack_completions
from grpo_fleet.learner.step.forward import frozen_logprobs
from grpo_fleet.learner.step.fused_check import CheckedGroup, Recheck, fused_check
from grpo_fleet.learner.step.rows import Sharding
from grpo_fleet.runtime.trees import flat_leaves


@contextmanager
def weights_of(model: nn.Module, weights: Sequence[tuple[str, Any]]) -> Iterator[nn.Module]:
    """`model` under `weights` (its trainable ones, as tree_flatten gives them), the live ones back after.

    The live weights may be past the last published version (train.sync_every > 1): always swap, then restore.
    """
    live = flat_leaves(model.trainable_parameters())
    model.update(tree_unflatten(list(weights)))
    try:
        yield model
    finally:
        model.update(tree_unflatten(live))


def recompute(model: nn.Module, own: TrainBatch, *, temperature: float, micro_batch_tokens: int,
              chunk_tokens: int) -> np.ndarray:
    """`own.recheck`'s rows of `own`, recomputed each under its version: `[n, L]`, 0 in the rows not recomputed."""
    recheck = own.recheck
    assert recheck is not None, "only a batch with older groups to recompute"
    out = np.zeros(own.mask.shape, np.float32)
    for slot, weights in enumerate(recheck.versions):
        rows = np.flatnonzero(recheck.rows == slot)
        if rows.size == 0:
            continue
        part = take_rows(own, rows)
        micro = split_batch(part, micro_batch_tokens)
        with weights_of(model, weights):
            values = frozen_logprobs(model, micro, temperature=temperature, chunk_tokens=chunk_tokens)
        out[rows] = unpack_completions(micro, values, (rows.size, own.mask.shape[1]))
    return out


def judge(grid: np.ndarray, batch: TrainBatch, recheck: Recheck) -> list[CheckedGroup]:
    """Each recomputed group's gaps over its recomputed rows (`grid`: every rank's, summed), against its bound."""
    picked = (recheck.rows >= 0)[:, None]
    return fused_check(grid, np.array(batch.old_logprobs), np.array(batch.mask) * picked, recheck.bounds)


def check_older(model: nn.Module, batch: TrainBatch, own: TrainBatch, sharding: Sharding, *, temperature: float,
                micro_batch_tokens: int, chunk_tokens: int) -> tuple[list[CheckedGroup], int]:
    """`batch.recheck`'s groups: this rank's rows of them (`own`) recomputed at their versions, every rank's
    judged (the same verdicts on every rank); and how many rows this rank recomputed."""
    if batch.recheck is None or own.recheck is None:
        return [], 0
    local = recompute(model, own, temperature=temperature, micro_batch_tokens=micro_batch_tokens,
                      chunk_tokens=chunk_tokens)
    grid = sharding.gather_rows(local, batch.mask.shape[0])
    return judge(grid, batch, batch.recheck), int(np.count_nonzero(own.recheck.rows >= 0))


def slowest_check(sharding: Sharding, batch: TrainBatch, seconds: float) -> float:
    """A step's check seconds on its slowest rank: a collective only when every rank knows the step checked."""
    checks = batch.recheck is not None or (batch.check is not None and bool(np.isfinite(batch.check).any()))
    return sharding.slowest(seconds) if checks else seconds
