"""What the ranks add to a collective is authenticated too (learner/ranks/ring_guard.py gather_checked): a gradient
or a grid row altered on the way is refused with a counted reason, and nothing is allocated for a header or a
broadcast whose size is not rank 0's."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any, Callable, Iterator, cast

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.config import DistributedConfig
from grpo_fleet.learner.ranks.collectives import MAX_BROADCAST_BYTES, RankGroup, Watchdog
from grpo_fleet.learner.ranks.distributed import DataParallel
from grpo_fleet.learner.ranks.ring_guard import check_backend, checked_sum, prove_ring
from grpo_fleet.learner.ranks.ring_trust import RingRefused, as_words, payload_tag
from grpo_fleet.learner.ranks.sharding import HEADER_SIZE, Command, Header, shard_rows

SECRET = b"s" * 32


class _Rank1:
    """Rank 1 of 2 as its gathers see the ring: rank 0's arrays and tags arrive after `tamper` had its way."""

    def __init__(self, theirs: list[np.ndarray], tags: list[bytes], tamper: Callable[[np.ndarray], None] = lambda _: None):
        self.rank, self.size, self.ring_key, self.gathers = 1, 2, SECRET, 0
        self.refusals: Counter[str] = Counter()
        self.theirs, self.tags, self.tamper = theirs, tags, tamper

    def gather_slots(self, slots: np.ndarray, what: str, *, idle: bool = False) -> np.ndarray:
        out = slots.copy()
        out[0] = as_words(self.tags.pop(0))
        return out

    def gather(self, arrays: list[mx.array], what: str) -> list[list[mx.array]]:
        theirs = self.theirs.pop(0).copy()
        self.tamper(theirs)
        return [[mx.array(theirs)], [mx.array(np.array(a)) for a in arrays]]


def _rank0_sends(what: str, *contributions: np.ndarray) -> tuple[list[np.ndarray], list[bytes]]:
    """Rank 0's arrays for the run's first gathers, and the tag it sends with each (its number in the run)."""
    return list(contributions), [payload_tag(SECRET, what, n, 0, [c]) for n, c in enumerate(contributions)]


def test_the_ranks_gradients_are_summed_from_their_checked_contributions():
    theirs, tags = _rank0_sends("gradient all-sum", np.array([1.0, 2.0, 3.0], np.float32))
    ranks = _Rank1(theirs, tags)
    summed = checked_sum(cast(Any, ranks), {"grads": mx.array([10.0, 20.0, 30.0])}, "gradient all-sum")
    assert np.array(summed["grads"]).tolist() == [11.0, 22.0, 33.0] and ranks.refusals == Counter()


class _Bounds(Watchdog):
    """A watchdog that records each collective's bound instead of arming a timer."""

    def __init__(self) -> None:
        super().__init__(rank=0)
        self.seen: list[tuple[str, float]] = []

    @contextmanager
    def bound(self, what: str, seconds: float) -> Iterator[None]:
        self.seen.append((what, seconds))
        yield


def test_a_steps_gathers_are_bound_by_the_step_timeout_and_only_the_ring_proof_by_the_idle_one():
    # A stopped rank must end rank 0 within timeout_seconds wherever the step is: the gradient sum's tag gather
    # once waited under idle_timeout_seconds (900 s), so a rank stopped there hung rank 0 for 15 minutes.
    cfg, dog = DistributedConfig(timeout_seconds=8, idle_timeout_seconds=900), _Bounds()
    ranks = RankGroup(mx.distributed.init(), cfg, watchdog=dog)  # the one-process group: no sockets
    summed = checked_sum(ranks, {"grads": mx.array([1.0, 2.0])}, "gradient all-sum")
    assert np.array(summed["grads"]).tolist() == [1.0, 2.0]
    assert [seconds for _, seconds in dog.seen] == [8, 8], dog.seen
    dog.seen.clear()
    assert prove_ring(ranks) == []
    assert [seconds for _, seconds in dog.seen] == [900, 900], dog.seen


def _bump(array: np.ndarray) -> None:
    array[1] += 1e-3  # a man in the middle nudges one gradient


@pytest.mark.parametrize("case", ["altered", "replayed", "another run's key"])
def test_a_gradient_altered_replayed_or_forged_on_the_way_is_refused_and_counted(case: str):
    gradient = np.array([1.0, 2.0, 3.0], np.float32)
    theirs, tags = _rank0_sends("gradient all-sum", gradient, gradient)
    tamper: Callable[[np.ndarray], None] = _bump if case == "altered" else lambda _: None
    if case == "replayed":  # the first step's gradient and tag, where the second belongs
        theirs, tags = theirs[:1] * 2, tags[:1] * 2
    if case == "another run's key":
        tags = [payload_tag(b"another run", "gradient all-sum", n, 0, [gradient]) for n in range(2)]
    ranks = _Rank1(theirs, tags, tamper)
    if case == "replayed":
        checked_sum(cast(Any, ranks), {"grads": mx.zeros(3)}, "gradient all-sum")
    with pytest.raises(RingRefused, match="rank 1: the gradient all-sum from rank.s. 0 failed its HMAC"):
        checked_sum(cast(Any, ranks), {"grads": mx.zeros(3)}, "gradient all-sum")
    assert ranks.refusals == Counter({"bad tag": 1})


def test_a_grid_row_altered_on_the_way_is_refused():
    """The logprob check's grid: each rank's rows travel with their tag, padded to the most rows a rank has."""
    total, grid = 5, np.arange(15, dtype=np.float32).reshape(5, 3)
    rows0, rows1 = shard_rows(total, 0, 2), shard_rows(total, 1, 2)
    sent = np.zeros((3, 3), np.float32)
    sent[:len(rows0)] = grid[rows0]
    theirs, tags = _rank0_sends("check all-sum", sent)
    honest = DataParallel(cast(Any, _Rank1(theirs, tags)), digest_every=1)
    assert np.array_equal(honest.gather_rows(grid[rows1], total), grid)
    theirs, tags = _rank0_sends("check all-sum", sent)
    ranks = _Rank1(theirs, tags, lambda rows: rows.__setitem__((0, 0), -50.0))
    with pytest.raises(RingRefused, match="check all-sum from rank.s. 0 failed its HMAC"):
        DataParallel(cast(Any, ranks), digest_every=1).gather_rows(grid[rows1], total)
    assert ranks.refusals["bad tag"] == 1


class _Wire:
    """A follower's broadcasts: the words rank 0 (or a man in the middle) put on the ring, and the collectives
    this rank was asked to run, by name."""

    def __init__(self, words: list[np.ndarray]) -> None:
        self.rank, self.size, self.ring_key, self.sequence = 1, 2, SECRET, 0
        self.refusals: Counter[str] = Counter()
        self.words, self.asked = words, []

    def announced(self) -> Any:
        return nullcontext()  # no doorbell: the broadcast is the wait

    def broadcast(self, arrays: list, what: str, *, idle: bool = False) -> list:
        self.asked.append(what)
        return [mx.array(self.words.pop(0))]


def test_a_header_announcing_a_huge_batch_is_refused_before_anything_is_allocated():
    forged = Header(Command.STEP, rows=1 << 30, width=1 << 30, num_groups=1 << 30).encode()
    forged[5:] = 7  # tags it cannot make without the ring secret
    wire = _Wire([forged])
    with pytest.raises(RingRefused, match="rank 1: rank 0's step command 0 failed its HMAC"):
        DataParallel(cast(Any, wire), digest_every=1).receive()
    assert wire.asked == ["waiting for rank 0's next command"] and wire.refusals == Counter({"bad tag": 1})
    negative = Header(Command.STEP, rows=-1, width=4, num_groups=1).encode()
    with pytest.raises(RingRefused, match="not one"):
        DataParallel(cast(Any, _Wire([negative])), digest_every=1).receive()


def test_a_broadcast_announcing_more_bytes_than_any_run_config_is_refused_before_allocating():
    group = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    ranks = RankGroup(cast(Any, group), DistributedConfig())
    lengths = [np.array([MAX_BROADCAST_BYTES + 1], np.int32)]
    asked: list[str] = []

    def broadcast(arrays: list, what: str, *, idle: bool = False) -> list:
        asked.append(what)
        return [mx.array(lengths.pop(0))]

    ranks.broadcast = broadcast  # type: ignore[method-assign]
    with pytest.raises(RingRefused, match=f"the run config is {MAX_BROADCAST_BYTES + 1} bytes"):
        ranks.broadcast_bytes(b"", "run config", idle=True)
    assert asked == ["run config (length)"] and ranks.refusals == Counter({"oversized": 1})


@pytest.mark.parametrize("backend,trusted,refused", [("mpi", False, True), ("jaccl", False, True),
                                                     ("mpi", True, False), ("ring", False, False)])
def test_mpi_and_jaccl_share_nothing_unless_their_network_is_declared_trusted(backend: str, trusted: bool,
                                                                              refused: bool):
    cfg = DistributedConfig(backend=backend, trusted_network=trusted)
    if refused:
        with pytest.raises(RingRefused, match=f"the {backend} backend has no ring door.*distributed.trusted_network"):
            check_backend(cfg)
    else:
        check_backend(cfg)


def test_a_header_carries_both_its_tags_through_encode_and_decode():
    head, batch = (np.array(words, np.int32).tobytes() for words in ([1, -2, 3, 4], [5, 6, -7, 2**31 - 1]))
    header = Header(Command.STEP, 4, 3, 2, tag=batch, versions=1, head_tag=head)
    assert Header.decode(header.encode()) == header and header.encode().shape == (HEADER_SIZE,)
    assert Header.decode(header.unsigned()) == Header(Command.STEP, 4, 3, 2, versions=1)
