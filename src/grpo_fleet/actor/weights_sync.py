"""Weight sync: fetch a policy snapshot in chunks, verify its digest, swap it in atomically.

It also tracks the two versions that matter to an actor: the one it has loaded
and the newest one the learner announced (which after a resume may be older).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Protocol

import mlx.nn as nn
from pydantic import BaseModel

from grpo_fleet.models.loading import load_weight_blob
from grpo_fleet.observe.metrics import ActorMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.weights import ChunkAssembler, VersionGone, WeightsMismatch

log = logging.getLogger("grpo_fleet.actor")
# Weight chunks requested ahead of the one being hashed (ZeroMQ guide's credit-based transfer).
CREDIT_WINDOW = 8


class ChunkSource(Protocol):
    """What a transfer needs from the link: send a request, await the chunk at an offset."""

    def send(self, msg: BaseModel) -> None: ...

    def await_chunk(self, offset: int) -> tuple[m.WeightsChunk, memoryview]: ...


class FetchedWeights(NamedTuple):
    """One version's whole blob, its digest already checked against the learner's announcement."""

    version: int
    blob: bytearray
    digest: str


def fetch_weights(source: ChunkSource, version: int) -> FetchedWeights:
    """Pull one version's blob with up to CREDIT_WINDOW chunk requests in flight.

    If `version` is gone already (two newer ones were published meanwhile), the
    learner says which it serves, and that one is fetched instead.
    """
    try:
        first, payload = _first_chunk(source, version)
    except VersionGone as gone:
        log.info("%s; fetching that", gone)
        first, payload = _first_chunk(source, gone.current)
    assembler = ChunkAssembler.from_first(first, chunk_bytes=max(first.length, 1))
    assembler.next_request()  # the first chunk is already here
    assembler.add(first, payload)
    in_flight = 0
    while not assembler.complete:
        while in_flight < CREDIT_WINDOW and (request := assembler.next_request()) is not None:
            source.send(request)
            in_flight += 1
        header, payload = source.await_chunk(offset=assembler.received)
        in_flight -= 1
        if not assembler.belongs(header):
            raise WeightsMismatch(f"learner switched to v{header.version} mid-transfer")
        assembler.add(header, payload)
    return FetchedWeights(assembler.version, assembler.blob(), assembler.digest)


def _first_chunk(source: ChunkSource, version: int) -> tuple[m.WeightsChunk, memoryview]:
    source.send(m.GetWeights(version=version, offset=0, length=0))
    return source.await_chunk(offset=0)


class WeightsSync:
    """The loaded policy version, the learner's newest, and the sync that brings one to the other."""

    def __init__(self, metrics: ActorMetrics) -> None:
        self.metrics = metrics
        self.loaded = -1  # the version in the model; -1 = none, or its number means nothing now
        self.newest = -1  # the learner's current version, as last announced

    @property
    def behind(self) -> bool:
        """The loaded version is not the learner's (either way: it follows backwards too)."""
        return self.newest != self.loaded

    def follow(self, version: int) -> None:
        """The learner announced `version` (a notice or a heartbeat)."""
        self.newest = version
        self.metrics.policy_lag.set(abs(self.newest - self.loaded))

    def forget(self) -> None:
        """Our version number may name other weights now (a new model, or a new learner life): reload."""
        self.loaded = -1

    def sync(self, source: ChunkSource, model: nn.Module) -> None:
        """Fetch the newest snapshot and swap it in only if its digest checks out; else keep the current one."""
        started = time.perf_counter()
        try:
            fetched = fetch_weights(source, max(self.newest, 0))
        except (WeightsMismatch, VersionGone) as exc:
            self.metrics.weight_syncs.labels(outcome="rejected").inc()
            log.error("refusing weights: %s; keeping v%d", shown(exc), self.loaded)
            return
        if fetched.version == self.loaded:
            return
        try:
            load_weight_blob(model, fetched.blob, fetched.digest)
        except ValueError as exc:
            self.metrics.weight_syncs.labels(outcome="rejected").inc()
            log.error("refusing weights v%d: %s", fetched.version, shown(exc))
            return
        self.loaded = fetched.version
        self.metrics.weight_syncs.labels(outcome="loaded").inc()
        self.metrics.weight_fetch_seconds.observe(time.perf_counter() - started)
        self.metrics.policy_version.set(self.loaded)
        self.metrics.policy_lag.set(abs(self.newest - self.loaded))
