"""The logprob check inside the step: reported logprobs against the training forward's own, at no extra cost.

A group sampled at the version the step trains from needs no forward of its
own to be checked: the step's first forward runs under exactly those weights,
and its logprobs at the completion positions are what an honest actor reported,
up to rounding. So the check is a comparison on the batch's `[N, L]` grid, made
after the first epoch's gradients and before they are applied. A group beyond
its bound fails the whole step: nothing is applied, and the caller drops the
liar's groups and trains the rest again.

The same comparison screens the batch's older groups too: the step's weights
are a few versions past theirs, so an honest group's tokens drift a little
from what its actor reported, but a token moved by many nats (a concentrated
lie: an old logprob reported far below what was sampled, so its ratio
dominates the step) stands out. A screen row has no mean bound (+inf) and a
loose token bound; a group beyond it breaks as "screen": nothing is applied,
and the caller recomputes it at its own version before it decides.

Plain NumPy over arrays the step already holds; the same on every
data-parallel rank, since each sees the same gathered grid and the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.learner.step.gap_bounds import GapBound, group_gap


@dataclass(frozen=True)
class CheckedGroup:
    """One group's gaps from a check, and which bound it broke ("mean", "token"), if any."""

    index: int  # the group's place in its batch (rows are group-major)
    mean: float
    worst: float
    broke: Optional[str]  # "mean" or "token" (a lie), "screen" (an older group to recompute at its version)


@dataclass(frozen=True)
class Recheck:
    """Older groups a data-parallel step recomputes at their own versions (learner/step/recheck.py), each rank
    its own rows of them, before anything is applied (`TrainBatch.recheck`)."""

    bounds: np.ndarray  # float32 [groups, 2]: (mean, token) bound of each group recomputed; +inf rows are not
    rows: np.ndarray  # int32 [N] (a rank's own: [n]): the index in `versions` each row is recomputed under; -1: not
    versions: tuple[tuple[tuple[str, mx.array], ...], ...]  # the trainable weights of each version, as tree_flatten

    def __post_init__(self) -> None:
        if not self.versions:
            raise ValueError("a Recheck needs the weights of at least one version")

    def of_rows(self, rows: np.ndarray) -> "Recheck":
        """The same check, for the sub-batch of `rows`: which of them to recompute, under which version."""
        return replace(self, rows=self.rows[rows])


def check_bounds_array(bounds: list[Optional[GapBound]], screens: Optional[dict[int, float]] = None) -> np.ndarray:
    """`[groups, 2]` float32 (mean, token) bounds for `TrainBatch.check`: +inf rows are not checked, and a
    screen row (`screens`: group index -> token bound) is (+inf, its token bound)."""
    out = np.full((len(bounds), 2), np.inf, np.float32)
    for index, token in (screens or {}).items():
        out[index, 1] = token
    for index, bound in enumerate(bounds):
        if bound is not None:
            out[index] = (bound.mean, bound.token)
    return out


def fused_check(recomputed: np.ndarray, reported: np.ndarray, mask: np.ndarray, bounds: np.ndarray) -> list[CheckedGroup]:
    """Each checked group's gaps between `reported` and `recomputed` (both `[N, L]`) where `mask` counts.

    `bounds` is `[groups, 2]`; the batch's rows are group-major, `N // groups` a group.
    Only the tokens the loss counts are compared: a masked token (an environment's,
    or a truncated completion's under grpo.mask_truncated) never trains, so a lie
    there moves nothing.
    """
    groups = bounds.shape[0]
    if groups == 0:
        return []
    per_group = recomputed.shape[0] // groups
    checked = []
    for index in np.flatnonzero(np.isfinite(bounds[:, 1])):
        rows = slice(int(index) * per_group, (int(index) + 1) * per_group)
        on = mask[rows] != 0
        mean, worst = group_gap(reported[rows][on], recomputed[rows][on])
        bound = GapBound(float(bounds[index, 0]), float(bounds[index, 1]))
        broke = bound.judge(mean, worst)
        if broke is not None and not np.isfinite(bounds[index, 0]):
            broke = "screen"
        checked.append(CheckedGroup(int(index), mean, worst, broke))
    return checked

