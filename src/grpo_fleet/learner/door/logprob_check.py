"""Trust, but verify, the logprobs: what an actor reports is checked against what the learner computes.

The learner owns the policy's weights. A random sample of the informative groups
of every submission (`security.logprob_checks_per_submission`) is re-scored under
the weights of the version it claims, kept for the versions still trainable
(`WeightHistory`), before it trains. A mean per-token gap beyond the honest
bound for the actor's and the learner's dtypes (learner/step/gap_bounds.py, or
`security.max_logprob_gap`) is `logprob_mismatch`: wrong weights, altered
logprobs, and a lied-about or stale version all show up as a gap. Such an actor
is banned at once and its buffered groups are dropped, so nothing from it is
trained after that. The rewards are checked in learner/door/reward_check.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.step.batch import build_train_batch, split_batch, unpack_completions
from grpo_fleet.learner.step.forward import frozen_logprobs

log = logging.getLogger("grpo_fleet.learner")


class WeightHistory:
    """The trainable weights of the versions still within reach of training, by version.

    MLX arrays are immutable and an optimizer update makes new ones, so keeping
    a version costs a reference per array: nothing under LoRA, the trainable
    weights once more per kept version under full fine-tuning.
    """

    def __init__(self, model: nn.Module, keep: int) -> None:
        self.model, self.keep = model, keep
        self.versions: dict[int, list[tuple[str, mx.array]]] = {}

    def record(self, version: int) -> None:
        flat: Any = tree_flatten(self.model.trainable_parameters())  # a list of (name, array) pairs
        self.versions[version] = list(flat)
        for old in [v for v in self.versions if v < version - self.keep]:
            del self.versions[old]


@dataclass(frozen=True)
class LogprobGap:
    group_id: str
    mean: float
    max: float
    bound: float  # the largest mean an honest group has


class LogprobCheck:
    """Recomputes a group's logprobs under the version it claims (training thread only: it swaps weights)."""

    def __init__(self, model: nn.Module, history: WeightHistory, *, temperature: float, chunk_tokens: int,
                 micro_batch_tokens: int, max_gap: Optional[float] = None, observe: Optional[Any] = None,
                 observe_seconds: Optional[Any] = None) -> None:
        self.model, self.history, self.observe, self.observe_seconds = model, history, observe, observe_seconds
        self.temperature, self.chunk_tokens, self.micro_batch_tokens = temperature, chunk_tokens, micro_batch_tokens
        self.max_gap = max_gap  # security.max_logprob_gap: overrides each group's own bound when set

    def gap(self, group: AcceptedGroup) -> Optional[LogprobGap]:
        """Mean and max |reported - recomputed| over the group's tokens; None when that version is not kept."""
        return self.gaps([group])[0]

    def gaps(self, groups: Sequence[AcceptedGroup]) -> list[Optional[LogprobGap]]:
        """`gap` of each group, in order: one forward per claimed version (and group size), not one per group,
        since on a small model a forward's cost is mostly per call."""
        found: list[Optional[LogprobGap]] = [None] * len(groups)
        together: dict[tuple[int, int], list[int]] = {}
        for index, group in enumerate(groups):
            together.setdefault((group.policy_version, len(group.completions)), []).append(index)
        for (version, _), indices in together.items():
            weights = self.history.versions.get(version)
            if weights is None:
                continue
            started = time.perf_counter()
            members = [groups[i] for i in indices]
            for index, gap in zip(indices, self._recomputed(members, weights)):
                found[index] = gap
            if self.observe_seconds is not None:  # on the step's path: the fleet simulator needs it
                per_group = (time.perf_counter() - started) / len(indices)
                for _ in indices:
                    self.observe_seconds(per_group)
        return found

    def _recomputed(self, groups: list[AcceptedGroup], weights: list[tuple[str, mx.array]]) -> list[LogprobGap]:
        """The groups' gaps under `weights`, in one batch."""
        # The live weights may be past the last published version (train.sync_every > 1): always swap, then restore.
        live: Any = tree_flatten(self.model.trainable_parameters())
        self.model.update(tree_unflatten(weights))
        try:
            batch = build_train_batch(groups)
            micro = split_batch(batch, self.micro_batch_tokens)
            values = frozen_logprobs(self.model, micro, temperature=self.temperature, chunk_tokens=self.chunk_tokens)
            rows, width = batch.mask.shape
            ours = unpack_completions(micro, values, (rows, width))
        finally:
            self.model.update(tree_unflatten(live))
        mask, reported = np.array(batch.mask) != 0, np.array(batch.old_logprobs)
        gaps, first = [], 0
        for group in groups:
            own = slice(first, first + len(group.completions))  # rows are group-major
            first = own.stop
            diff = np.abs(reported[own][mask[own]] - ours[own][mask[own]])
            bound = self.max_gap if self.max_gap is not None else group.logprob_bound
            gaps.append(LogprobGap(group.group_id, float(diff.mean()) if diff.size else 0.0,
                                   float(diff.max()) if diff.size else 0.0, bound))
        return gaps

    def failures(self, groups: Sequence[AcceptedGroup]) -> list[tuple[AcceptedGroup, LogprobGap]]:
        """The groups among `groups` whose gap is beyond their bound (the dtypes', or security.max_logprob_gap)."""
        failed = []
        for group, gap in zip(groups, self.gaps(groups)):
            if gap is not None and self.observe is not None:
                self.observe(gap.mean)
            if gap is not None and gap.mean > gap.bound:
                failed.append((group, gap))
        return failed


def check_next_batch(lock: Any, state: Any, intake: Any, check: LogprobCheck, count: int) -> bool:
    """Check the flagged groups of the next batch (training thread); False when some failed and were dropped.

    The groups are read under the lock, recomputed outside it (requests keep
    being answered), and a failure is applied under it again: the actor is
    banned and its buffered groups dropped, so the caller looks again.
    """
    with lock:
        flagged = [g for g in state.buffer[:count] if g.check_logprobs]
    if not flagged:
        return True
    failures = check.failures(flagged)
    with lock:
        for group in flagged:
            group.check_logprobs = False
        if failures:
            intake.blame_tampered(failures)
    return not failures
