"""Chunked weight transfer: slicing on the learner, reassembly and digest check on the actor."""

from __future__ import annotations

import os

import pytest

from grpo_fleet.protocol.messages import WeightsChunk, blob_digest
from grpo_fleet.protocol.weights import ChunkAssembler, Snapshot, WeightsMismatch


@pytest.fixture
def snapshot() -> Snapshot:
    blob = os.urandom(10_000)
    return Snapshot(version=3, blob=blob, digest=blob_digest(blob))


def _transfer(snapshot: Snapshot, chunk: int) -> ChunkAssembler:
    first, raw = snapshot.chunk(0, 0, default_length=chunk)
    assembler = ChunkAssembler.from_first(first, chunk_bytes=first.length)
    assembler.next_request()
    assembler.add(first, raw)
    while (request := assembler.next_request()) is not None:
        header, raw = snapshot.chunk(request.offset, request.length)
        assert assembler.belongs(header)
        assembler.add(header, raw)
    return assembler


@pytest.mark.parametrize("chunk", [1, 999, 4096, 10_000, 1 << 20])
def test_any_chunk_size_reassembles_the_exact_blob(snapshot, chunk):
    assembler = _transfer(snapshot, chunk)
    assert assembler.complete and assembler.blob() == snapshot.blob


def test_chunks_are_zero_copy_views_clamped_to_the_blob(snapshot):
    header, raw = snapshot.chunk(9_000, 5_000)
    assert isinstance(raw, memoryview) and raw.obj is snapshot.blob
    assert (header.offset, header.length, header.total_bytes) == (9_000, 1_000, 10_000)


def test_tampered_bytes_fail_the_digest(snapshot):
    forged = Snapshot(version=3, blob=bytes(len(snapshot.blob)), digest=snapshot.digest)
    with pytest.raises(WeightsMismatch, match="digest"):
        _transfer(forged, 4096).blob()


def test_out_of_order_or_short_chunks_are_refused(snapshot):
    first, raw = snapshot.chunk(0, 4096)
    assembler = ChunkAssembler.from_first(first, chunk_bytes=4096)
    later, later_raw = snapshot.chunk(4096, 4096)
    with pytest.raises(WeightsMismatch):
        assembler.add(later, later_raw)
    with pytest.raises(WeightsMismatch):
        assembler.add(first, raw[:10])
    with pytest.raises(WeightsMismatch, match="only"):
        assembler.blob()


def test_a_new_version_mid_transfer_is_detected(snapshot):
    first, _ = snapshot.chunk(0, 4096)
    assembler = ChunkAssembler.from_first(first, chunk_bytes=4096)
    moved_on = WeightsChunk(version=4, digest="0" * 64, total_bytes=10_000, offset=4096, length=4096)
    assert not assembler.belongs(moved_on)
