"""The pure side of trusting the ring: address classes, the ring proof over slots, and the step headers' HMAC."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from grpo_fleet.learner.ranks.distributed import DataParallel
from grpo_fleet.learner.ranks.rank_metrics import CollectiveTotals
from grpo_fleet.learner.ranks.ring_trust import (
    RingRefused,
    check_ring_network,
    failed_proofs,
    header_tag,
    host_of,
    hostfile_addresses,
    network_kind,
    nonce_slots,
    proof_slots,
)
from grpo_fleet.learner.ranks.sharding import Command, Header
from grpo_fleet.learner.step.batch import TrainBatch
from grpo_fleet.learner.step.fused_check import Recheck

SECRET = bytes(range(32))


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1:32323", "loopback"), ("[::1]:32323", "loopback"), ("10.1.2.3:1", "private"),
    ("172.16.0.9:1", "private"), ("172.32.0.9:1", "public"), ("192.168.1.20:32324", "private"),
    ("169.254.3.4:1", "private"), ("[fe80::1%en0]:1", "private"), ("[fd12:3456::1]:1", "private"),
    ("8.8.8.8:32323", "public"), ("100.64.0.1:1", "public"), ("[2001:db8::1]:1", "public"), ("mac-mini.local:1", "public"),
])
def test_addresses_are_loopback_private_or_public(address: str, kind: str):
    assert network_kind(host_of(address)) == kind


def test_a_public_ring_is_refused_unless_the_network_is_trusted():
    with pytest.raises(RingRefused, match="non-private addresses .*8.8.8.8:1.*trusted_network"):
        check_ring_network(["10.0.0.1:1", "8.8.8.8:1"], authenticated=True, trusted=False)
    check_ring_network(["10.0.0.1:1", "8.8.8.8:1"], authenticated=True, trusted=True)


def test_a_ring_beyond_loopback_needs_keys_or_a_trusted_network():
    with pytest.raises(RingRefused, match="needs keys"):
        check_ring_network(["127.0.0.1:1", "192.168.1.2:1"], authenticated=False, trusted=False)
    check_ring_network(["127.0.0.1:1", "192.168.1.2:1"], authenticated=True, trusted=False)
    check_ring_network(["127.0.0.1:1", "192.168.1.2:1"], authenticated=False, trusted=True)
    check_ring_network(["127.0.0.1:1", "127.0.0.1:2"], authenticated=False, trusted=False)


def test_the_hostfile_is_mlx_launchs_list_of_lists():
    assert hostfile_addresses('[["10.0.0.1:5"], ["10.0.0.2:6", "10.0.0.2:7"]]') == [["10.0.0.1:5"], ["10.0.0.2:6", "10.0.0.2:7"]]
    with pytest.raises(ValueError, match="list of lists"):
        hostfile_addresses('{"hosts": 1}')


def _gathered(slots: list[np.ndarray]) -> np.ndarray:
    """What an all-sum of every rank's slots gives (each rank writes its own row only)."""
    return np.sum(slots, axis=0, dtype=np.int32)


def _proof(keys: list[bytes]) -> list[int]:
    size = len(keys)
    nonces = _gathered([nonce_slots(rank, size, np.random.default_rng(rank).bytes(32)) for rank in range(size)])
    tags = _gathered([proof_slots(key, rank, nonces) for rank, key in enumerate(keys)])
    return failed_proofs(SECRET, nonces, tags)


def test_every_rank_holding_the_secret_passes_the_proof():
    assert _proof([SECRET, SECRET, SECRET]) == []


def test_a_rank_without_the_secret_is_named():
    assert _proof([SECRET, b"", SECRET]) == [1]
    assert _proof([b"guess" * 7, SECRET, SECRET]) == [0]


def test_a_proof_from_other_nonces_does_not_replay():
    nonces = _gathered([nonce_slots(rank, 2, bytes([rank + 1]) * 32) for rank in range(2)])
    old = _gathered([proof_slots(SECRET, rank, nonces) for rank in range(2)])
    fresh = nonces.copy()
    fresh[0, 0] += 1  # rank 0's new nonce in the next run
    assert failed_proofs(SECRET, fresh, old) == [0, 1]


def test_a_header_tag_covers_its_number_its_fields_and_its_batch():
    words = Header(Command.STEP, rows=4, width=3, num_groups=2).encode()
    batch = [np.arange(12, dtype=np.int32).reshape(4, 3), np.ones((2, 2), np.float32)]
    base = header_tag(SECRET, 7, words, batch)
    assert base.shape == (4,)
    assert not np.array_equal(base, header_tag(SECRET, 8, words, batch))  # replayed later
    altered = [batch[0].copy(), batch[1]]
    altered[0][1, 1] += 1
    assert not np.array_equal(base, header_tag(SECRET, 7, words, altered))
    assert not np.array_equal(base, header_tag(SECRET, 7, Header(Command.STOP).encode(), batch))
    assert not np.array_equal(base, header_tag(b"", 7, words, batch))
    assert np.array_equal(base, header_tag(SECRET, 7, words, [a.copy() for a in batch]))


def test_a_signed_header_carries_its_tag_through_encode_and_decode():
    tag = np.array([1, -2, 3, 2**31 - 1], np.int32).tobytes()
    decoded = Header.decode(Header(Command.STEP, 4, 3, 2, tag=tag).encode())
    assert decoded == Header(Command.STEP, 4, 3, 2, tag=tag)


class _Wire:
    """RankGroup.broadcast without a ring: rank 0's arrays are recorded as sent, a follower reads them back (after
    whatever a man in the middle did to them)."""

    def __init__(self, rank: int, sent: list, key: bytes) -> None:
        self.rank, self.size, self.ring_key, self.sequence = rank, 2, key, 0
        self.refusals: Counter[str] = Counter()
        self.sent = sent
        self.listener: Any = None  # rank 0's doorbell, as a follower hears it

    def announced(self) -> Any:
        return nullcontext()  # no doorbell: the broadcast is the wait

    def broadcast(self, arrays: list, what: str, *, idle: bool = False) -> list:
        if self.rank == 0:
            self.sent.append([np.array(a) for a in arrays])
            return arrays
        return [mx.array(a) + 0 for a in self.sent.pop(0)]  # the ring's sum: rank 0's values plus the others' zeros

    def all_sum(self, tree: list, what: str) -> list:
        """As DataParallel sends the weights of the versions to check: only rank 0's are not zeros."""
        if self.rank == 0:
            self.sent.append([np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in tree])
            return tree
        return [mx.array(a).view(t.dtype) + 0 for a, t in zip(self.sent.pop(0), tree)]


def _batch() -> TrainBatch:
    ids = mx.array(np.arange(12, dtype=np.int32).reshape(4, 3))
    return TrainBatch(inputs=ids, targets=ids + 1, mask=mx.ones((4, 3)), old_logprobs=mx.zeros((4, 3)),
                      advantages=mx.array([1.0, -1.0, 0.5, -0.5]), rewards=mx.array([1.0, 0.0, 1.0, 0.0]), num_groups=2)


def _sent(steps: int) -> list:
    sent: list = []
    leader = DataParallel(cast(Any, _Wire(0, sent, SECRET)), digest_every=1)
    for _ in range(steps):
        leader.begin(_batch())
    return sent


def _receive(sent: list, key: bytes = SECRET) -> tuple[_Wire, list[TrainBatch]]:
    wire = _Wire(1, sent, key)
    follower = DataParallel(cast(Any, wire), digest_every=1)
    batches = []
    while sent:
        batches.append(follower.receive_batch(follower.receive()))
    return wire, batches


def test_a_follower_takes_rank_0s_signed_batches():
    wire, batches = _receive(_sent(2))
    assert len(batches) == 2 and np.array_equal(np.array(batches[1].advantages), [1.0, -1.0, 0.5, -0.5])
    assert wire.refusals == Counter()


def test_a_follower_refuses_a_batch_altered_on_the_way():
    sent = _sent(1)
    sent[1][4][0] = 9.0  # the advantages of the first sequence, as a man in the middle would raise them
    with pytest.raises(RingRefused, match="rank 1: rank 0's step command 0 failed its HMAC"):
        _receive(sent)


def test_a_follower_refuses_a_replayed_batch_and_one_signed_without_the_secret():
    first, second = _sent(2)[0:2], _sent(1)
    with pytest.raises(RingRefused, match="step command 1 failed its HMAC"):
        _receive(first + second)  # the first step again, where rank 0's second belongs
    with pytest.raises(RingRefused, match="failed its HMAC"):
        _receive(_sent(1), key=b"another run's secret")


def test_the_ring_refusals_are_exported_by_reason_and_rank():
    wire = _Wire(0, [], SECRET)
    wire.refusals.update({"key not allowed": 2, "malformed knock": 1})
    wire.totals = {}  # type: ignore[attr-defined]
    registry = CollectorRegistry()
    registry.register(CollectiveTotals(cast(Any, wire)))
    name = "grpo_fleet_learner_ring_refusals_total"
    assert registry.get_sample_value(name, {"reason": "key not allowed", "rank": "0"}) == 2
    assert registry.get_sample_value(name, {"reason": "malformed knock", "rank": "0"}) == 1
    assert registry.get_sample_value("grpo_fleet_learner_rank_doorbell_waits_total", {"result": "rang", "rank": "0"}) is None


def test_a_followers_doorbell_waits_are_exported_by_how_they_ended():
    wire = _Wire(1, [], SECRET)
    wire.totals = {}  # type: ignore[attr-defined]
    wire.listener = SimpleNamespace(rang=7, missed=2)
    registry = CollectorRegistry()
    registry.register(CollectiveTotals(cast(Any, wire)))
    name = "grpo_fleet_learner_rank_doorbell_waits_total"
    assert registry.get_sample_value(name, {"result": "rang", "rank": "1"}) == 7
    assert registry.get_sample_value(name, {"result": "silent", "rank": "1"}) == 2


def _weights(scale: float) -> tuple[tuple[str, mx.array], ...]:
    """Two adapters, one in bfloat16, each with a -0.0 (which arrives as 0.0: the tag must not mind)."""
    return (("layers.0.lora_a", mx.array([[-0.0, 1, 2], [3, 4, 5]]) * scale),
            ("layers.0.lora_b", (mx.array([-0.0, 1, 1]) * scale).astype(mx.bfloat16)))


def test_a_follower_takes_the_weights_of_the_versions_to_check_signed_with_their_batch():
    batch = _batch()
    batch.old_logprobs = -batch.old_logprobs  # -0.0 where nothing is reported, as a masked product leaves it
    batch.recheck = Recheck(np.array([[0.01, 0.5], [np.inf, np.inf]], np.float32), np.array([0, -1, 1, 0], np.int32),
                            (_weights(1.0), _weights(2.0)))
    sent: list = []
    DataParallel(cast(Any, _Wire(0, sent, SECRET)), digest_every=1).begin(batch)
    altered = [[a.copy() for a in part] for part in sent]
    follower = DataParallel(cast(Any, _Wire(1, sent, SECRET)), digest_every=1)
    got = follower.receive_batch(follower.receive(), [(name, mx.zeros_like(v)) for name, v in _weights(0.0)])
    assert got.recheck is not None
    assert got.recheck.rows.tolist() == [0, -1, 1, 0] and got.recheck.bounds[0].tolist() == pytest.approx([0.01, 0.5])
    for mine, theirs in zip(got.recheck.versions, batch.recheck.versions):
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        for (_, a), (_, b) in zip(mine, theirs):
            assert a.dtype == b.dtype and mx.array_equal(a, b)  # equal: -0.0 == 0.0
    altered[2][1][0] += 1  # one bfloat16 word of the first version's lora_b, changed on the way
    follower = DataParallel(cast(Any, _Wire(1, altered, SECRET)), digest_every=1)
    with pytest.raises(RingRefused, match="failed its HMAC"):
        follower.receive_batch(follower.receive(), [(name, mx.zeros_like(v)) for name, v in _weights(0.0)])
