"""Weight chunks ZeroMQ still holds for a peer, and the bound on the blobs they keep alive.

A chunk goes out zero-copy, as a view into its version's serialised blob, so as long as libzmq holds one
chunk it keeps that whole blob alive, after the snapshot store has dropped the version too. The ROUTER
queues replies per peer, up to 1,000 messages, and says nothing of how deep a queue is: a peer that asks for
every new version and never reads would keep one blob per version. So each chunk is sent with a tracker, and
a weights request that would hold more than this bound is refused:

- one peer key (the actor's CURVE key; its routing id without CURVE) holds one version at most, in at most
  MAX_QUEUED_CHUNKS chunks: a request for another version, or for more chunks, while its earlier chunks are
  still queued is refused (`peer_busy`);
- all peers together hold MAX_VERSIONS_IN_FLIGHT distinct versions at most (`versions_cap`).

The learner's weight memory is then at most the store's two blobs plus MAX_VERSIONS_IN_FLIGHT held ones.
An actor that reads its socket lets go within a round trip, so an honest one rarely meets a refusal; it is
answered WeightsGone naming the current version, and the actor fetches that one again (actor/weights_sync.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m

# Distinct versions that queued chunks may hold, all peers together: the current one, the one before it (an
# actor mid-transfer), and one older.
MAX_VERSIONS_IN_FLIGHT = 3
# Queued chunks per peer key: the actor's credit window (8) for each of 32 actors sharing one key.
MAX_QUEUED_CHUNKS = 256


class Tracker(Protocol):
    """zmq.MessageTracker, as far as this needs it: whether libzmq has let go of the frame."""

    @property
    def done(self) -> bool: ...


@dataclass
class _Queued:
    """One peer key's chunks still held by libzmq: all of one version, so they hold one blob."""

    version: int
    blob_bytes: int
    trackers: deque[Tracker] = field(default_factory=deque)

    def release(self) -> None:
        # Front only: one peer's chunks leave in the order they were queued, and this stays cheap per request.
        while self.trackers and self.trackers[0].done:
            self.trackers.popleft()


class WeightsInFlight:
    """Which blobs queued weight chunks hold, per peer key; says whether one more chunk may be sent."""

    def __init__(self, metrics: LearnerMetrics, max_versions: int = MAX_VERSIONS_IN_FLIGHT,
                 max_chunks: int = MAX_QUEUED_CHUNKS) -> None:
        self.metrics, self.max_versions, self.max_chunks = metrics, max_versions, max_chunks
        self.queued: dict[str, _Queued] = {}

    def refusal(self, owner: str, chunk: m.WeightsChunk) -> Optional[str]:
        """Why `chunk` may not go to peer key `owner` now (counted), or None."""
        reason = self._reason(owner, chunk)
        if reason is not None:
            self.metrics.weights_refusals.labels(reason=reason).inc()
        return reason

    def _reason(self, owner: str, chunk: m.WeightsChunk) -> Optional[str]:
        held = self.queued.get(owner)
        if held is not None:
            held.release()
            if held.trackers:
                same = held.version == chunk.version and len(held.trackers) < self.max_chunks
                return None if same else "peer_busy"
            del self.queued[owner]
        if chunk.version in self.held():
            return None
        self.release()  # every peer's, before counting what they hold
        versions = self.held()
        return "versions_cap" if chunk.version not in versions and len(versions) >= self.max_versions else None

    def sent(self, owner: str, chunk: m.WeightsChunk, tracker: Optional[Tracker]) -> None:
        """`chunk` went to `owner`; `tracker` is None when it was copied (it holds no blob)."""
        self.metrics.weight_bytes_served.inc(chunk.length)
        if tracker is not None:
            self.queued.setdefault(owner, _Queued(chunk.version, chunk.total_bytes)).trackers.append(tracker)
        self._publish()

    def release(self) -> None:
        """Forget the chunks libzmq has let go of (periodically, so the gauge falls as peers read)."""
        for owner, held in list(self.queued.items()):
            held.release()
            if not held.trackers:
                del self.queued[owner]
        self._publish()

    def held(self) -> dict[int, int]:
        """Version -> blob bytes, for each version a queued chunk holds."""
        return {held.version: held.blob_bytes for held in self.queued.values()}

    def _publish(self) -> None:
        self.metrics.weight_reply_bytes_held.set(sum(self.held().values()))
