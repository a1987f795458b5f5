"""The data-parallel step's side of the ranks: the batch broadcast, its rows sharded, the gradients all-summed.

`DataParallel` is the `Sharding` a Trainer uses on every rank once the run is shared (distributed.py starts it;
follower.py is the other ranks' loop). Kept apart from the run's start and end across the ranks (distributed.py).
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import replace
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from grpo_fleet.learner.ranks.collectives import RankGroup
from grpo_fleet.learner.ranks.ring_guard import checked_sum, gather_checked
from grpo_fleet.learner.ranks.ring_trust import RingRefused, header_tag
from grpo_fleet.learner.ranks.sharding import HEADER_SIZE, Command, Header, shard_rows
from grpo_fleet.learner.step.batch import MicroBatch, TrainBatch, take_rows
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.objective import proximal_grid
from grpo_fleet.learner.step.step_result import Gradients

log = logging.getLogger("grpo_fleet.learner.ranks")

# A TrainBatch's arrays in the order they are broadcast, each in the dtype it travels in.
BATCH_FIELDS: tuple[tuple[str, mx.Dtype], ...] = (
    ("inputs", mx.int32), ("targets", mx.int32), ("mask", mx.float32), ("old_logprobs", mx.float32),
    ("advantages", mx.float32), ("rewards", mx.float32),
)


class DataParallel:
    """`Trainer.sharding` on a rank of a group of several: its rows, and all-sums that make them the batch's."""

    def __init__(self, ranks: RankGroup, digest_every: int) -> None:
        self.ranks, self.digest_every = ranks, digest_every
        self.size = ranks.size
        self.steps = 0
        self.rows = np.arange(0)
        self.last_command = time.monotonic()

    def begin(self, batch: TrainBatch) -> None:
        """Rank 0 hands the batch to the others, who are waiting for it (follower.py), with the weights of the
        versions its older groups are recomputed at (each rank its own rows: learner/step/recheck.py)."""
        if self.ranks.rank == 0:
            rows, width = batch.mask.shape
            # The step's own logprob check runs on every rank, on the gathered grid: each must judge the same groups.
            arrays = [*(getattr(batch, name).astype(dtype) for name, dtype in BATCH_FIELDS), mx.array(check_rows(batch))]
            recheck, weights, versions = batch.recheck, [], 0
            if recheck is not None:
                arrays += [mx.array(recheck.bounds.astype(np.float32)), mx.array(recheck.rows.astype(np.int32))]
                weights, versions = [value for version in recheck.versions for _, value in version], len(recheck.versions)
            self.send(Header(Command.STEP, rows=rows, width=width, num_groups=batch.num_groups, versions=versions),
                      arrays + weights)
            self.ranks.broadcast(arrays, "step batch")
            if weights:  # packed into few collectives: one per array would pay the ring's latency hundreds of times
                self.ranks.all_sum(weights, "check versions")

    def own_rows(self, batch: TrainBatch) -> TrainBatch:
        self.rows = shard_rows(batch.mask.shape[0], self.ranks.rank, self.ranks.size)
        return take_rows(batch, self.rows)

    def combine(self, gradients: Gradients) -> Gradients:
        summed = checked_sum(self.ranks, {"loss": gradients.loss, "stats": gradients.stats, "grads": gradients.grads},
                             "gradient all-sum")
        return Gradients(loss=summed["loss"], stats=summed.get("stats", {}), grads=summed["grads"],
                         policy_logprobs=gradients.policy_logprobs)

    def combine_proximal(self, batch: TrainBatch, own: TrainBatch, micro: list[MicroBatch],
                         proximal: list[mx.array]) -> Optional[np.ndarray]:
        """Each rank's pi_prox rows scattered onto a zero `[N, L]` grid and summed: the whole grid, exactly."""
        local = proximal_grid(own, micro, proximal)
        # None is the same on every rank: it depends on the loss function only.
        return None if local is None else self.gather_rows(local, batch.mask.shape[0], "pi_prox all-sum")

    def gather_rows(self, values: np.ndarray, total: int, what: str = "check all-sum") -> np.ndarray:
        """This rank's rows of values (`own_rows`' order) and every other rank's, each checked against its tag
        (`gather_checked`), on the batch's `[N, L]` grid."""
        most = -(-total // self.size)  # the most rows a rank has: each sends that many, padded
        padded = np.zeros((most, *values.shape[1:]), values.dtype)
        padded[:len(values)] = values
        pieces = [np.array(piece) for (piece,) in gather_checked(self.ranks, [mx.array(padded)], what)]
        grid = np.zeros((total, *values.shape[1:]), pieces[0].dtype)
        for rank, piece in enumerate(pieces):
            rows = shard_rows(total, rank, self.size)
            grid[rows] = piece[:len(rows)]
        return grid

    def slowest(self, seconds: float) -> float:
        return self.ranks.most(seconds, "check seconds (max)")

    def end(self, model: nn.Module) -> None:
        self.steps += 1
        if self.steps % self.digest_every == 0:
            self.ranks.check_identical(model.trainable_parameters(), self.steps)

    def idle(self) -> None:
        """Rank 0, waiting for a batch: tell the others it is alive, every `keepalive_seconds`."""
        if self.ranks.rank == 0 and time.monotonic() - self.last_command >= self.ranks.cfg.keepalive_seconds:
            self.send(Header(Command.KEEPALIVE))

    def send(self, header: Header, arrays: tuple[mx.array, ...] | list[mx.array] = ()) -> None:
        """Rank 0: the header, signed over its number in the run: its fields alone, and with the batch `arrays`
        it announces."""
        sequence, unsigned = self.ranks.sequence, header.unsigned()
        self.ranks.sequence += 1
        signed = replace(header, head_tag=self._tag(sequence, unsigned, None),
                         tag=self._tag(sequence, unsigned, [signable(a) for a in arrays]))
        with self.ranks.announced():
            self.ranks.broadcast([mx.array(signed.encode())], f"{header.command.name.lower()} command")
        self.last_command = time.monotonic()

    def _tag(self, sequence: int, unsigned: np.ndarray, arrays: Optional[list[np.ndarray]]) -> bytes:
        """The header's fields' tag (`arrays` None), or its tag with the batch it announces."""
        purpose = "step command" if arrays is None else "step header"
        return header_tag(self.ranks.ring_key, sequence, unsigned, arrays or [], purpose).tobytes()

    def verify(self, header: Header, arrays: Optional[list[np.ndarray]]) -> None:
        """The others: refuse (RingRefused) the header just taken unless its fields (`arrays` None), or its fields
        and the batch `arrays`, match their tag."""
        sequence = self.ranks.sequence - 1
        tag = header.head_tag if arrays is None else header.tag
        if not hmac.compare_digest(self._tag(sequence, header.unsigned(), arrays), tag):
            self.ranks.refusals["bad tag"] += 1
            raise RingRefused(f"rank {self.ranks.rank}: rank 0's {header.command.name.lower()} command {sequence} "
                              "failed its HMAC: altered on the way, or not from rank 0")

    def receive(self) -> Header:
        """The others: rank 0's next command (waited for up to `idle_timeout_seconds`), its fields checked before
        anything is allocated for the batch a step announces (that batch is checked in `receive_batch`)."""
        with self.ranks.announced():
            (words,) = self.ranks.broadcast([mx.zeros(HEADER_SIZE, dtype=mx.int32)],
                                            "waiting for rank 0's next command", idle=True)
        try:
            header = Header.decode(np.array(words))
        except ValueError as exc:
            raise RingRefused(f"rank {self.ranks.rank}: rank 0's command is not one ({exc})") from None
        self.ranks.sequence += 1
        self.verify(header, None)
        return header

    def receive_batch(self, header: Header, trainable: Sequence[tuple[str, mx.array]] = ()) -> TrainBatch:
        """The others: rank 0's batch, checked; `trainable` (tree_flatten's) shapes the weights of its versions."""
        rows, width, groups = header.rows, header.width, header.num_groups
        grid, row = (rows, width), (rows,)
        shapes = {"inputs": grid, "targets": grid, "mask": grid, "old_logprobs": grid, "advantages": row, "rewards": row}
        templates = [*(mx.zeros(shapes[name], dtype=dtype) for name, dtype in BATCH_FIELDS),
                     mx.zeros((groups, 2), dtype=mx.float32)]
        if header.versions:
            templates += [mx.zeros((groups, 2), dtype=mx.float32), mx.zeros((rows,), dtype=mx.int32)]
        received = self.ranks.broadcast(templates, "step batch")
        templates = [mx.zeros_like(v) for _ in range(header.versions) for _, v in trainable]
        weights = self.ranks.all_sum(templates, "check versions") if templates else []
        self.verify(header, [signable(a) for a in [*received, *weights]])
        arrays, checked = received[:len(BATCH_FIELDS)], np.array(received[len(BATCH_FIELDS)])
        names, count = [name for name, _ in trainable], len(trainable)
        versions = tuple(tuple(zip(names, weights[i * count:(i + 1) * count])) for i in range(header.versions))
        recheck = Recheck(np.array(received[-2]), np.array(received[-1]), versions) if versions else None
        return TrainBatch(**{name: value for (name, _), value in zip(BATCH_FIELDS, arrays)}, num_groups=groups,
                          check=checked if np.isfinite(checked).any() else None, recheck=recheck)


def signable(array: mx.array) -> np.ndarray:
    """An array's bytes as the others receive them, for a tag: -0.0 as 0.0 (a broadcast adds their zeros), and
    bfloat16 (which NumPy has not) as its 16-bit words."""
    if mx.issubdtype(array.dtype, mx.floating):
        array = array + 0.0
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def check_rows(batch: TrainBatch) -> np.ndarray:
    """`TrainBatch.check` as it travels: `[groups, 2]`, +inf where a group is not checked (all of it for None)."""
    if batch.check is not None:
        return batch.check.astype(np.float32)
    return np.full((batch.num_groups, 2), np.inf, np.float32)
