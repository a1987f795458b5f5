"""The data-parallel learner's collectives over `mx.distributed`, each one under a watchdog.

MLX's ring backend has open reports of collectives that hang (ml-explore/mlx
#4475, #3862, #3755), and a rank that dies makes its peers' next collective
fail. Either way this rank logs which collective and which peer, writes
nothing more, and exits with `exit_codes.RANKS_FAILED`: the run resumes from
rank 0's last checkpoint, and the actors keep retrying meanwhile. No partial
checkpoint can be written, since checkpoints are written on the training
thread, the one waiting in the collective.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from grpo_fleet.config import DistributedConfig
from grpo_fleet.learner.ranks.ring_trust import RingRefused, hostfile_addresses
from grpo_fleet.learner.ranks.sharding import DIGEST_WORDS, buckets, weights_digest
from grpo_fleet.protocol.doorbell import BellListener, Doorbell
from grpo_fleet.runtime.exit_codes import RANKS_FAILED
from grpo_fleet.runtime.trees import flat_leaves

log = logging.getLogger("grpo_fleet.learner.ranks")
# Gradients travel in flat buckets of at most this many bytes (mlx.nn.average_gradients uses 32 MiB).
BUCKET_BYTES = 32 << 20
# The most bytes a rank takes in one broadcast of bytes (the run config with its state layout: a few hundred kB
# for the largest models).
MAX_BROADCAST_BYTES = 64 << 20


def exit_now(message: str) -> NoReturn:
    """Log `message` and end the process at once: no checkpoint, no cleanup that could wait on a peer."""
    log.critical("%s", message)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(RANKS_FAILED)


class Watchdog:
    """Ends the process when a collective outlives its bound; `on_expiry` is `exit_now` outside tests."""

    def __init__(self, rank: int, on_expiry: Callable[[str], Any] = exit_now) -> None:
        self.rank, self.on_expiry = rank, on_expiry

    @contextmanager
    def bound(self, what: str, seconds: float) -> Iterator[None]:
        message = (f"rank {self.rank}: {what} did not finish within {seconds:g} s (a peer hung, stopped or "
                   "unreachable); exiting without a checkpoint. Resume from rank 0's last checkpoint.")
        timer = threading.Timer(seconds, self.on_expiry, args=(message,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def launched_rank() -> Optional[int]:
    """This process's rank when `mlx.launch` (ring, JACCL) or mpirun started it; None for a plain process."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def launched_backend(configured: str, environ: Mapping[str, str]) -> str:
    """The mx.distributed backend to start: the configured one, or for 'auto' the one the launcher prepared."""
    if configured != "auto":
        return configured
    if "OMPI_COMM_WORLD_RANK" in environ or "PMI_RANK" in environ:
        return "mpi"
    if "MLX_JACCL_COORDINATOR" in environ:
        return "jaccl"
    return "ring"


def ring_hostfile(cfg: DistributedConfig, environ: Mapping[str, str]) -> Optional[list[list[str]]]:
    """The ring's `ip:port` addresses, one list per rank, when this process is a rank of a ring; else None."""
    path = environ.get("MLX_HOSTFILE")
    if launched_backend(cfg.backend, environ) != "ring" or not path:
        return None
    return hostfile_addresses(Path(path).read_text())


def init_group(cfg: DistributedConfig, rank: int) -> mx.distributed.Group:
    """Connect to the other ranks, or exit non-zero after `idle_timeout_seconds`.

    MLX holds the GIL while it connects, so a Python timer could not fire:
    faulthandler's own thread does (it dumps the stack and exits).
    """
    bound, backend = cfg.idle_timeout_seconds, launched_backend(cfg.backend, os.environ)
    log.info("rank %d: connecting to the other ranks (backend %s, hostfile %s); giving up after %g s",
             rank, backend, os.environ.get("MLX_HOSTFILE", "-"), bound)
    sys.stderr.flush()
    faulthandler.dump_traceback_later(bound, exit=True)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    finally:
        faulthandler.cancel_dump_traceback_later()
    log.info("rank %d of %d connected", group.rank(), group.size())
    return group


class Packed:
    """A tree's leaves packed into a few flat buckets of one dtype each (`sharding.buckets`), and back."""

    def __init__(self, tree: Any) -> None:
        self.pairs = flat_leaves(tree)
        leaves = [value for _, value in self.pairs]
        self.groups = buckets([v.nbytes for v in leaves], [str(v.dtype) for v in leaves], BUCKET_BYTES)
        self.flats = [mx.concatenate([leaves[i].reshape(-1) for i in group]) for group in self.groups]

    def unpack(self, flats: list[mx.array]) -> Any:
        """The tree again, its leaves cut from `flats` (arrays of `self.flats`' shapes: their sums, say)."""
        leaves = [value for _, value in self.pairs]
        out: list[Optional[mx.array]] = [None] * len(leaves)
        for group, flat in zip(self.groups, flats):
            offsets = np.cumsum([leaves[i].size for i in group])[:-1].tolist()
            for i, piece in zip(group, mx.split(flat, offsets) if offsets else [flat]):
                out[i] = piece.reshape(leaves[i].shape)
        return tree_unflatten([(key, value) for (key, _), value in zip(self.pairs, out)])


class RankGroup:
    """The collectives the ranks run, each evaluated at once under the watchdog."""

    def __init__(self, group: mx.distributed.Group, cfg: DistributedConfig, watchdog: Optional[Watchdog] = None) -> None:
        self.group, self.cfg = group, cfg
        self.rank, self.size = group.rank(), group.size()
        self.watchdog = watchdog or Watchdog(self.rank)
        # Per collective name: [seconds waited, bytes sent in], since the start; the benchmark reads them.
        self.totals: dict[str, list[float]] = {}
        # The run's ring secret (ring_trust.py): b"" on a ring that runs without keys (loopback, trusted network).
        self.ring_key = b""
        self.sequence = 0  # commands rank 0 has sent (or this rank has taken): each header's tag covers it
        self.gathers = 0  # checked gathers run (ring_guard.gather_checked): each contribution's tag covers it
        self.refusals: Counter[str] = Counter()  # by reason: knocks at the ring door, and the ring's proofs
        # Rank 0 rings `bell` while it sends a command; the others sleep on `listener` until it does
        # (protocol/doorbell.py: MLX's ring spins while it waits). None before the run is shared, or off the ring.
        self.bell: Optional[Doorbell] = None
        self.listener: Optional[BellListener] = None
        self.rings = 0  # broadcasts rank 0 has announced on its doorbell (or this rank has waited for)

    @contextmanager
    def announced(self) -> Iterator[None]:
        """Around a broadcast that the others wait for, maybe for minutes: rank 0 rings its doorbell through it;
        the others first sleep until it rings, or until it has been silent for three heartbeats."""
        number = self.rings
        self.rings += 1
        if self.rank == 0:
            with self.bell.ringing(number) if self.bell is not None else nullcontext():
                yield
            return
        if self.listener is not None and not self.listener.wait(number):
            log.info("rank %d: no word from rank 0's doorbell for three heartbeats; waiting in the ring", self.rank)
        yield

    def peers(self) -> str:
        others = [r for r in range(self.size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))

    def run(self, what: str, arrays: list[mx.array], reduce: Callable[..., mx.array], *,
            idle: bool = False) -> list[mx.array]:
        """`reduce` over the ranks of each array, finished before it returns (or the process ends)."""
        mx.eval(arrays)  # the inputs' own compute is not the collective's time
        seconds = self.cfg.idle_timeout_seconds if idle else self.cfg.timeout_seconds
        started = time.perf_counter()
        with self.watchdog.bound(what, seconds):
            try:
                out = []
                for array in arrays:
                    # One collective per eval: with several in one eval, MLX 0.32's ring hangs when a peer is
                    # lost instead of raising (seen here; the watchdog would still end it, but unnamed).
                    out.append(reduce(array, group=self.group, stream=mx.cpu))
                    mx.eval(out[-1])
            except RuntimeError as exc:
                exit_now(f"rank {self.rank}: {what} failed ({exc}): {self.peers()} is gone; "
                         "exiting without a checkpoint. Resume from rank 0's last checkpoint.")
        total = self.totals.setdefault(what, [0.0, 0.0])
        total[0] += time.perf_counter() - started
        total[1] += sum(a.nbytes for a in arrays)
        return out

    def all_sum(self, tree: Any, what: str) -> Any:
        """The tree (of arrays) summed over the ranks, its leaves packed into few flat buckets (`sharding.buckets`)."""
        packed = Packed(tree)
        return packed.unpack(self.run(what, packed.flats, mx.distributed.all_sum))

    def gather(self, arrays: list[mx.array], what: str) -> list[list[mx.array]]:
        """Every rank's `arrays` (of the same shapes on every rank, at least 1-D), by rank: an all-gather of each."""
        gathered = self.run(what, arrays, mx.distributed.all_gather)
        return [[whole[rank * a.shape[0]:(rank + 1) * a.shape[0]] for whole, a in zip(gathered, arrays)]
                for rank in range(self.size)]

    def broadcast(self, arrays: list[mx.array], what: str, *, idle: bool = False) -> list[mx.array]:
        """Rank 0's arrays on every rank: the others pass arrays of the same shapes and dtypes (their values unused).

        An all-sum where only rank 0 contributes, so exact in every dtype.
        """
        mine = arrays if self.rank == 0 else [mx.zeros_like(a) for a in arrays]
        return self.run(what, mine, mx.distributed.all_sum, idle=idle)

    def most(self, value: float, what: str) -> float:
        """The largest of the ranks' `value`s."""
        (out,) = self.run(what, [mx.array([value], dtype=mx.float32)], mx.distributed.all_max)
        return float(np.array(out)[0])

    def gather_slots(self, slots: np.ndarray, what: str, *, idle: bool = False) -> np.ndarray:
        """An all-gather: each rank's `[size, ...]` grid holds its own row (zeros elsewhere); the sum is every row.

        `idle` for the ring's proof at start-up only: a step's gathers are bound by `timeout_seconds`."""
        (out,) = self.run(what, [mx.array(slots)], mx.distributed.all_sum, idle=idle)
        return np.array(out)

    def broadcast_bytes(self, data: bytes, what: str, *, idle: bool = False) -> bytes:
        """Rank 0's bytes on every rank (the others pass b""): the length first, then the bytes.

        A length over MAX_BROADCAST_BYTES is refused (RingRefused) before anything is allocated for it: the
        bytes' HMAC (ring_guard.receive_signed) can only be checked once they are here."""
        (length,) = self.broadcast([mx.array([len(data)], dtype=mx.int32)], f"{what} (length)", idle=idle)
        size = int(np.array(length)[0])
        if not 0 <= size <= MAX_BROADCAST_BYTES:
            self.refusals["oversized"] += 1
            raise RingRefused(f"rank {self.rank}: the {what} is {size} bytes, not 0 to {MAX_BROADCAST_BYTES}: "
                              "altered on the way, or not from rank 0")
        buffer = np.frombuffer(data, dtype=np.uint8) if self.rank == 0 else np.zeros(size, np.uint8)
        (out,) = self.broadcast([mx.array(buffer)], what, idle=idle)
        return bytes(np.array(out))

    def check_identical(self, tree: Any, step: int) -> None:
        """Exit loudly unless every rank's `tree` (the trainable weights) is bitwise the same as the others'."""
        words = mx.array(weights_digest(tree))
        (high,) = self.run("weights digest (max)", [words], mx.distributed.all_max)
        (low,) = self.run("weights digest (min)", [words], mx.distributed.all_min)
        if not bool(mx.array_equal(high, low)) or high.shape != (DIGEST_WORDS,):
            exit_now(f"rank {self.rank}: the ranks' weights differ at step {step} (digest all-max {np.array(high)} "
                     f"!= all-min {np.array(low)}): a rank computed a different update. Exiting without a checkpoint.")
