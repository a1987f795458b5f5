"""Tests for grpo_fleet.learner.door.weights_in_flight: the blobs that queued weight chunks hold stay bounded."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_fleet.learner.door.weights_in_flight import WeightsInFlight
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import messages as m

BLOB = 1 << 20


@dataclass
class FakeTracker:
    done: bool = False


def _chunk(version: int, blob: int = BLOB) -> m.WeightsChunk:
    return m.WeightsChunk(version=version, digest="d" * 64, total_bytes=blob, offset=0, length=min(blob, 4096))


def _held_bytes(flight: WeightsInFlight) -> float:
    return flight.metrics.weight_reply_bytes_held._value.get()


def _refusals(flight: WeightsInFlight, reason: str) -> float:
    return flight.metrics.weights_refusals.labels(reason=reason)._value.get()


def test_a_peer_that_never_reads_holds_one_version_however_many_it_asks_for():
    flight = WeightsInFlight(learner_metrics())
    stuck = FakeTracker()
    assert flight.refusal("hoarder", _chunk(0)) is None
    flight.sent("hoarder", _chunk(0), stuck)
    for version in range(1, 20):  # a new version each time, never reading
        assert flight.refusal("hoarder", _chunk(version)) == "peer_busy"
    assert flight.held() == {0: BLOB} and _held_bytes(flight) == BLOB
    assert _refusals(flight, "peer_busy") == 19
    stuck.done = True  # it read at last: the next version is its
    assert flight.refusal("hoarder", _chunk(19)) is None


def test_more_chunks_of_the_same_version_are_taken_up_to_the_cap():
    flight = WeightsInFlight(learner_metrics(), max_chunks=4)
    for _ in range(4):
        assert flight.refusal("actor", _chunk(3)) is None
        flight.sent("actor", _chunk(3), FakeTracker())
    assert flight.refusal("actor", _chunk(3)) == "peer_busy"
    assert _held_bytes(flight) == BLOB, "chunks of one version share its blob"


def test_all_peers_together_hold_at_most_the_cap_of_distinct_versions():
    flight = WeightsInFlight(learner_metrics(), max_versions=3)
    for version in range(3):
        flight.sent(f"peer{version}", _chunk(version), FakeTracker())
    assert flight.refusal("newcomer", _chunk(3)) == "versions_cap"
    assert flight.refusal("newcomer", _chunk(2)) is None, "a version already held costs nothing more"
    assert _held_bytes(flight) == 3 * BLOB and _refusals(flight, "versions_cap") == 1


def test_released_and_copied_chunks_hold_nothing():
    flight = WeightsInFlight(learner_metrics())
    tracker = FakeTracker()
    flight.sent("a", _chunk(1), tracker)
    flight.sent("b", _chunk(2), None)  # small enough to copy: libzmq holds no view of the blob
    assert flight.held() == {1: BLOB}
    tracker.done = True
    flight.release()
    assert flight.held() == {} and _held_bytes(flight) == 0
    assert flight.metrics.weight_bytes_served._value.get() == 2 * 4096
