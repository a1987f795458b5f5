"""Published weights: serialise each version once, keep the one before it, serve either in chunks."""

from __future__ import annotations

from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.models.loading import Policy, trainable_weights, weights_to_bytes
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.weights import Snapshot


class SnapshotStore:
    """The current snapshot and its predecessor; every actor gets these same bytes."""

    def __init__(self, policy: Policy, chunk_bytes: int, metrics: LearnerMetrics, version: int = 0) -> None:
        self.policy, self.chunk_bytes, self.metrics = policy, chunk_bytes, metrics
        self.versions: dict[int, Snapshot] = {}
        self.current = self.serialize(version)
        self.install(self.current)

    def serialize(self, version: int) -> Snapshot:
        """The policy's trainable weights now, as `version`: on the training thread, or before serving starts."""
        blob = weights_to_bytes(trainable_weights(self.policy.model))
        return Snapshot(version=version, blob=blob, digest=m.blob_digest(blob))

    def install(self, snapshot: Snapshot) -> None:
        """Make `snapshot` current, keeping the previous version so an actor mid-transfer can finish it."""
        self.versions = {v: s for v, s in self.versions.items() if v == snapshot.version - 1}
        self.versions[snapshot.version] = snapshot
        self.current = snapshot

    def chunk(self, request: m.GetWeights) -> Reply:
        """One chunk of the requested version; a version no longer kept gets WeightsGone naming the current one."""
        snapshot = self.versions.get(request.version)
        if snapshot is None:
            return Reply(m.WeightsGone(requested=request.version, current=self.current.version))
        header, raw = snapshot.chunk(request.offset, request.length, self.chunk_bytes)
        return Reply(header, raw)  # counted as served once sent, within the bound (door/weights_in_flight.py)
