"""Snapshot sync on the actor: chunked fetch under the credit window, digest check, atomic swap. No sockets."""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import mlx.nn as nn
import pytest

from grpo_fleet.actor.weights_sync import CREDIT_WINDOW, WeightsSync, fetch_weights
from grpo_fleet.models.loading import trainable_weights, weights_to_bytes
from grpo_fleet.observe.metrics import actor_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.weights import Snapshot, VersionGone, WeightsMismatch


class FakeLearner:
    """Answers GetWeights from snapshots in request order, as the learner does on one connection."""

    def __init__(self, *snapshots: Snapshot, chunk: int = 64) -> None:
        self.snapshots = deque(snapshots)  # the learner moves on to the next one after the first chunk
        self.chunk = chunk
        self.queue: deque[m.GetWeights] = deque()
        self.most_in_flight = 0

    def send(self, msg: object) -> None:
        assert isinstance(msg, m.GetWeights)
        self.queue.append(msg)
        self.most_in_flight = max(self.most_in_flight, len(self.queue))

    def await_chunk(self, offset: int) -> tuple[m.WeightsChunk, memoryview]:
        request = self.queue.popleft()
        snapshot = self.snapshots[0]
        if request.version != snapshot.version and request.offset == 0:
            raise VersionGone(request.version, snapshot.version)  # what the link makes of WeightsGone
        if request.offset > 0 and len(self.snapshots) > 1:
            self.snapshots.popleft()
            snapshot = self.snapshots[0]
        header, raw = snapshot.chunk(request.offset, request.length, default_length=self.chunk)
        assert header.offset == offset
        return header, raw


def _snapshot(version: int, weights: dict[str, mx.array]) -> Snapshot:
    blob = weights_to_bytes(weights)
    return Snapshot(version=version, blob=blob, digest=m.blob_digest(blob))


@pytest.fixture
def model() -> nn.Module:
    layer = nn.Linear(16, 16)
    mx.eval(layer.parameters())
    return layer


def _syncs(sync: WeightsSync, outcome: str) -> float:
    value = sync.metrics.registry.get_sample_value("grpo_fleet_actor_weight_syncs_total", {"outcome": outcome})
    return value or 0.0


def test_a_fetch_reassembles_the_blob_with_at_most_the_credit_window_in_flight(model: nn.Module) -> None:
    snapshot = _snapshot(4, trainable_weights(model))
    learner = FakeLearner(snapshot, chunk=32)
    fetched = fetch_weights(learner, 4)
    assert (fetched.version, bytes(fetched.blob), fetched.digest) == (4, snapshot.blob, snapshot.digest)
    assert 1 < learner.most_in_flight <= CREDIT_WINDOW
    _, blob, _ = fetched  # the weights benchmark unpacks it
    assert blob == snapshot.blob


def test_a_version_that_is_gone_is_replaced_by_the_one_the_learner_names(model: nn.Module) -> None:
    snapshot = _snapshot(9, trainable_weights(model))
    fetched = fetch_weights(FakeLearner(snapshot, chunk=32), 4)
    assert (fetched.version, bytes(fetched.blob)) == (9, snapshot.blob)


def test_a_learner_that_moves_on_mid_transfer_is_refused(model: nn.Module) -> None:
    weights = trainable_weights(model)
    learner = FakeLearner(_snapshot(4, weights), _snapshot(5, {k: v + 1 for k, v in weights.items()}), chunk=32)
    with pytest.raises(WeightsMismatch, match="switched to v5"):
        fetch_weights(learner, 4)


def test_sync_swaps_in_the_newest_version_and_follows_it_backwards(model: nn.Module) -> None:
    sync = WeightsSync(actor_metrics())
    new = {k: v + 0.5 for k, v in trainable_weights(model).items()}
    sync.follow(7)
    assert sync.behind
    sync.sync(FakeLearner(_snapshot(7, new)), model)
    assert sync.loaded == 7 and not sync.behind and _syncs(sync, "loaded") == 1
    assert all(mx.array_equal(trainable_weights(model)[k], new[k]) for k in new)
    sync.follow(3)  # a resumed learner is older
    assert sync.behind
    sync.sync(FakeLearner(_snapshot(3, new)), model)
    assert sync.loaded == 3 and sync.metrics.policy_version._value.get() == 3


def test_a_blob_that_does_not_fit_is_refused_and_the_current_weights_kept(model: nn.Module) -> None:
    sync = WeightsSync(actor_metrics())
    before = trainable_weights(model)
    sync.follow(2)
    sync.sync(FakeLearner(_snapshot(2, {"not.a.weight": mx.zeros((2,))})), model)
    assert sync.loaded == -1 and _syncs(sync, "rejected") == 1
    assert all(mx.array_equal(trainable_weights(model)[k], before[k]) for k in before)


def test_a_corrupted_blob_is_refused(model: nn.Module) -> None:
    sync = WeightsSync(actor_metrics())
    good = _snapshot(2, trainable_weights(model))
    bad = Snapshot(version=2, blob=good.blob[:-1] + bytes([good.blob[-1] ^ 1]), digest=good.digest)
    sync.follow(2)
    sync.sync(FakeLearner(bad), model)
    assert sync.loaded == -1 and _syncs(sync, "rejected") == 1


def test_the_version_already_loaded_is_not_swapped_again(model: nn.Module) -> None:
    sync = WeightsSync(actor_metrics())
    snapshot = _snapshot(1, trainable_weights(model))
    sync.follow(1)
    sync.sync(FakeLearner(snapshot), model)
    sync.sync(FakeLearner(snapshot), model)
    assert _syncs(sync, "loaded") == 1
    sync.forget()  # a new learner life: the number may name other weights
    assert sync.behind
