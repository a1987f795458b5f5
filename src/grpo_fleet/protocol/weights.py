"""Weight blobs in chunks: what the learner slices off, and how an actor reassembles and checks them.

Pure bookkeeping, no sockets. The learner answers `GetWeights{version, offset,
length}` with a `WeightsChunk` header plus the raw bytes; the actor keeps a few
requests in flight (a credit window), hashes chunks as they arrive in order, and
only hands the blob over when every byte is there and the digest matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import blake3

from grpo_fleet.protocol.messages import GetWeights, WeightsChunk

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Snapshot:
    """A published policy version: its serialized weights and their digest."""

    version: int
    blob: bytes
    digest: str

    def chunk(self, offset: int, length: int, default_length: int = DEFAULT_CHUNK_BYTES) -> tuple[WeightsChunk, memoryview]:
        """Header and zero-copy view of the requested slice (clamped to the blob)."""
        offset = min(offset, len(self.blob))
        length = min(length or default_length, len(self.blob) - offset)
        header = WeightsChunk(
            version=self.version, digest=self.digest, total_bytes=len(self.blob), offset=offset, length=length
        )
        return header, memoryview(self.blob)[offset : offset + length]


class WeightsMismatch(ValueError):
    """The reassembled blob is not what the learner announced."""


class VersionGone(Exception):
    """The learner no longer keeps the version asked for (WeightsGone); `current` is the one it serves."""

    def __init__(self, requested: int, current: int) -> None:
        super().__init__(f"v{requested} is gone; the learner serves v{current}")
        self.requested, self.current = requested, current


@dataclass
class ChunkAssembler:
    """Collects the chunks of one version, in order, hashing as it goes."""

    version: int
    digest: str
    total_bytes: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    _buffer: bytearray = field(init=False)
    _hasher: "blake3.blake3" = field(init=False)
    _received: int = field(init=False, default=0)
    _requested: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._buffer = bytearray(self.total_bytes)
        self._hasher = blake3.blake3()

    @classmethod
    def from_first(cls, header: WeightsChunk, chunk_bytes: int) -> "ChunkAssembler":
        return cls(version=header.version, digest=header.digest, total_bytes=header.total_bytes, chunk_bytes=chunk_bytes)

    def next_request(self) -> Optional[GetWeights]:
        """The next slice to ask for, or None once every byte has been requested."""
        if self._requested >= self.total_bytes:
            return None
        length = min(self.chunk_bytes, self.total_bytes - self._requested)
        request = GetWeights(version=self.version, offset=self._requested, length=length)
        self._requested += length
        return request

    def belongs(self, header: WeightsChunk) -> bool:
        """False when the learner answered with another version (it moved on): start over."""
        return header.version == self.version and header.digest == self.digest and header.total_bytes == self.total_bytes

    def add(self, header: WeightsChunk, payload: memoryview | bytes) -> None:
        """Take the next chunk; chunks arrive in request order on one connection."""
        if header.offset != self._received or len(payload) != header.length:
            raise WeightsMismatch(f"chunk at {header.offset} (+{len(payload)}) does not follow byte {self._received}")
        self._buffer[header.offset : header.offset + header.length] = payload
        self._hasher.update(payload)
        self._received += header.length

    @property
    def received(self) -> int:
        """Bytes taken so far: the offset of the next chunk expected."""
        return self._received

    @property
    def complete(self) -> bool:
        return self._received == self.total_bytes

    def blob(self) -> bytearray:
        """The whole blob, after checking its digest (the assembly buffer itself: no extra copy)."""
        if not self.complete:
            raise WeightsMismatch(f"only {self._received} of {self.total_bytes} bytes arrived")
        if self._hasher.hexdigest() != self.digest:
            raise WeightsMismatch("weight blob digest mismatch")
        return self._buffer
