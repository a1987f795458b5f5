"""BLAKE3 digests of weight blobs: one definition for the wire (snapshot headers) and the model (the check before a swap)."""

from __future__ import annotations

import blake3


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3-256 hex digest of a weight blob (fast enough to check hundreds of MB per sync)."""
    return str(blake3.blake3(data).hexdigest())
