"""Which rows of a batch this process trains: all of them in one process; `DataParallel` shares them out."""

from __future__ import annotations

from typing import Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from grpo_fleet.learner.step.batch import MicroBatch, TrainBatch
from grpo_fleet.learner.step.objective import proximal_grid
from grpo_fleet.learner.step.step_result import Gradients


class Sharding(Protocol):
    """Which rows of a batch this process trains, and how its sums become the whole batch's."""

    size: int  # processes training each batch

    def begin(self, batch: TrainBatch) -> None: ...
    def own_rows(self, batch: TrainBatch) -> TrainBatch: ...
    def combine(self, gradients: Gradients) -> Gradients: ...
    def combine_proximal(self, batch: TrainBatch, own: TrainBatch, micro: list[MicroBatch],
                         proximal: list[mx.array]) -> Optional[np.ndarray]: ...
    def gather_rows(self, values: np.ndarray, total: int) -> np.ndarray: ...
    def slowest(self, seconds: float) -> float: ...
    def end(self, model: nn.Module) -> None: ...
    def idle(self) -> None: ...


class SingleProcess:
    """One process trains every row, and its sums are the batch's already; `DataParallel` (learner/ranks/distributed.py)
    spreads the rows over mx.distributed ranks instead."""

    size = 1

    def begin(self, batch: TrainBatch) -> None:
        """Before a step: nothing to tell anyone."""

    def own_rows(self, batch: TrainBatch) -> TrainBatch:
        return batch

    def combine(self, gradients: Gradients) -> Gradients:
        return gradients

    def combine_proximal(self, batch: TrainBatch, own: TrainBatch, micro: list[MicroBatch],
                         proximal: list[mx.array]) -> Optional[np.ndarray]:
        """pi_prox on the batch's `[N, L]` grid."""
        return proximal_grid(own, micro, proximal)

    def gather_rows(self, values: np.ndarray, total: int) -> np.ndarray:
        """Values of this process's rows (`own_rows`' order) on the batch's `[N, L]` grid: they are all of it."""
        return values

    def slowest(self, seconds: float) -> float:
        """The most `seconds` any process spent: these."""
        return seconds

    def end(self, model: nn.Module) -> None:
        """After a step: nothing to check."""

    def idle(self) -> None:
        """Waiting for a batch: nobody to tell."""
