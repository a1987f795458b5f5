"""Tests for grpo_fleet.learner.door.snapshots: one serialisation per version, the previous one kept, chunks served."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import messages as m


def _store() -> tuple[SnapshotStore, nn.Linear]:
    model = nn.Linear(4, 4)
    mx.eval(model.parameters())
    return SnapshotStore(SimpleNamespace(model=model), chunk_bytes=4096, metrics=learner_metrics()), model


def test_the_previous_version_is_kept_and_older_ones_dropped():
    store, model = _store()
    for version in (1, 2):
        model.weight = model.weight + 1.0
        store.install(store.serialize(version))
    assert sorted(store.versions) == [1, 2] and store.current.version == 2
    assert store.versions[1].digest != store.versions[2].digest


def test_a_chunk_is_a_typed_reply_with_its_bytes():
    store, _ = _store()
    reply = store.chunk(m.GetWeights(version=0, offset=8, length=16))
    assert isinstance(reply.message, m.WeightsChunk)
    assert (reply.message.offset, reply.message.length) == (8, 16)
    assert bytes(reply.raw) == store.current.blob[8:24]
    assert reply.message.digest == m.blob_digest(store.current.blob)


def test_a_version_that_is_gone_gets_an_explicit_answer_naming_the_current_one():
    store, _ = _store()
    store.install(store.serialize(1))
    store.install(store.serialize(2))
    reply = store.chunk(m.GetWeights(version=0))
    assert reply.message == m.WeightsGone(requested=0, current=2) and reply.raw is None
    assert store.chunk(m.GetWeights(version=1)).message.version == 1  # v-1 is kept
