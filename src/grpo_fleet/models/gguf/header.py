"""A GGUF file's header, read strictly: every count, length, offset and type checked against the file.

llama.cpp's format: magic, version, counts, key/value metadata, a tensor table,
then aligned tensor data. The `gguf` package's GGUFReader reads it too, but it
builds a Python object per array element (13 s and ~600 MB for Gemma 3's 262,144
tokens) and fails deep inside itself on a damaged file. Here a numeric array is
one numpy read, the tensors stay in a read-only memory map until asked for, and
a truncated, flipped or hostile file is one `GGUFError` that names the file and
the byte where reading stopped. The tensor bytes themselves are dequantized with
the `gguf` package's own dequantizers (weights.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from grpo_fleet.models.gguf.metadata import GGUFError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# Strings in all the metadata's arrays together. A short string costs ~6x its bytes in the file as a Python object,
# so a file of nothing else could need several times its size; real files stay far below (Llama 3: 128,256 tokens
# and 280,147 merges; Gemma 3: 262,144 tokens), and the vocabulary itself is held to 1 << 22 (gguf_metadata).
MAX_METADATA_STRINGS = 1 << 22
# Metadata value types (gguf's GGUFValueType): struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: where its bytes lie and what they are."""

    name: str
    shape: tuple[int, ...]  # numpy order (rows first): ggml's dims reversed
    kind: GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.kind.name


@dataclass
class GGUFFile:
    """The parsed header and a read-only map of the file for the tensor bytes."""

    path: Path
    metadata: dict[str, Any]  # scalars as Python values, numeric arrays as numpy, string arrays as lists
    tensors: list[TensorInfo]
    data: np.ndarray  # np.memmap of the whole file, uint8

    def raw(self, info: TensorInfo, rows: slice = slice(None)) -> np.ndarray:
        """A tensor's stored bytes, shaped (rows..., bytes per row), for `gguf.quants.dequantize`."""
        flat = self.data[info.start:info.start + info.nbytes]
        row_bytes = info.nbytes // max(1, math.prod(info.shape[:-1]))
        return flat.reshape(*info.shape[:-1], row_bytes)[rows]


class _Cursor:
    """Reads forward through the mapped file; every read past the end is a GGUFError naming where it stopped."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        self.data, self.path, self.pos, self.size = data, path, 0, int(data.shape[0])
        # Slicing the memmap itself builds an array object per read: a 262k-token vocabulary took seconds.
        self.view = memoryview(data)  # type: ignore[arg-type]
        self.what = "the header"
        self.strings_left = MAX_METADATA_STRINGS

    def fail(self, reason: str) -> GGUFError:
        return GGUFError(f"{self.path} is not a valid GGUF file: {reason} (at byte {self.pos} of {self.size}, in {self.what})")

    def need(self, count: int) -> None:
        if count < 0 or self.pos + count > self.size:
            raise self.fail(f"it ends early ({count} more bytes needed)")

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        self.need(width)
        value = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += width
        return value[0] if len(value) == 1 else value

    def string(self, limit: int) -> str:
        length = self.unpack("<Q")
        if length > limit:
            raise self.fail(f"a string of {length} bytes (at most {limit} here)")
        self.need(length)
        raw = bytes(self.view[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string that is not UTF-8 ({exc.reason})") from None

    def numbers(self, kind: int, count: int) -> np.ndarray:
        dtype = np.dtype(_NUMPY[kind])
        self.need(count * dtype.itemsize)
        values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return values.astype(bool) if kind == 7 else values


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header and tensor table; the tensor bytes are only mapped. Refuses anything malformed."""
    path = Path(path)
    try:
        data = np.memmap(path, mode="r", dtype=np.uint8)
    except (OSError, ValueError) as exc:  # a directory, an empty file, no permission
        raise GGUFError(f"cannot read {path} as a GGUF file: {exc}") from None
    cursor = _Cursor(data, path)
    if cursor.size < 24 or bytes(data[:4]) != MAGIC:
        raise cursor.fail("it does not start with the GGUF magic bytes")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in VERSIONS:
        raise cursor.fail(f"version {version} (this reader takes {', '.join(map(str, VERSIONS))}; "
                          "a big-endian file reads as a huge version)")
    _bounded(cursor, kv_count, 13, "metadata entries")
    metadata = _read_metadata(cursor, kv_count)
    _bounded(cursor, tensor_count, 24, "tensors")
    table = _read_tensor_table(cursor, tensor_count)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= 1 << 20 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    cursor.what = "the tensor table"
    return GGUFFile(path, metadata, _place_tensors(cursor, table, data_start, alignment), data)


def _bounded(cursor: _Cursor, count: int, smallest: int, what: str) -> None:
    """A count no file of this size could hold (each item takes at least `smallest` bytes) is refused up front."""
    if count * smallest > cursor.size - cursor.pos:
        raise cursor.fail(f"{count} {what} cannot fit in the {cursor.size - cursor.pos} bytes left")


def _read_metadata(cursor: _Cursor, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for index in range(count):
        cursor.what = f"metadata entry {index}"
        key = cursor.string(1 << 16)
        cursor.what = f"metadata {key!r}"
        if key in metadata:
            raise cursor.fail(f"the key {key!r} appears twice")
        metadata[key] = _read_value(cursor, cursor.unpack("<I"))
    return metadata


def _read_value(cursor: _Cursor, kind: int) -> Any:
    if kind in _SCALARS:
        return cursor.unpack(_SCALARS[kind])
    if kind == _STRING:
        return cursor.string(cursor.size)
    if kind != _ARRAY:
        raise cursor.fail(f"value type {kind}, which GGUF does not define")
    item, count = cursor.unpack("<IQ")
    if item in _NUMPY:
        return cursor.numbers(item, count)
    if item != _STRING:
        raise cursor.fail(f"an array of value type {item} (arrays of numbers or strings only)")
    _bounded(cursor, count, 8, "strings")
    if count > cursor.strings_left:
        raise cursor.fail(f"an array of {count} strings, past the {MAX_METADATA_STRINGS} the metadata may hold in all")
    cursor.strings_left -= count
    return [cursor.string(cursor.size) for _ in range(count)]


def _read_tensor_table(cursor: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]]:
    table, names = [], set()
    for index in range(count):
        cursor.what = f"tensor entry {index}"
        name = cursor.string(1 << 12)
        cursor.what = f"tensor {name!r}"
        if name in names:
            raise cursor.fail(f"the tensor {name!r} appears twice")
        names.add(name)
        dims = cursor.unpack("<I")
        if not 1 <= dims <= MAX_DIMS:
            raise cursor.fail(f"{dims} dimensions (1 to {MAX_DIMS})")
        ne = [int(cursor.unpack("<Q")) for _ in range(dims)]
        raw_kind, offset = cursor.unpack("<IQ")
        if any(n < 1 or n > 1 << 40 for n in ne) or math.prod(ne) > 1 << 40:
            raise cursor.fail(f"dimensions {ne}")
        try:
            kind = GGMLQuantizationType(raw_kind)
        except ValueError:
            raise cursor.fail(f"tensor type {raw_kind}, which ggml does not define") from None
        table.append((name, tuple(reversed(ne)), kind, int(offset)))
    return table


def _place_tensors(cursor: _Cursor, table: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]],
                   data_start: int, alignment: int) -> list[TensorInfo]:
    """Each tensor's bytes: whole blocks per row, aligned, inside the file, not overlapping another's."""
    tensors = []
    for name, shape, kind, offset in table:
        if kind not in GGML_QUANT_SIZES:
            raise cursor.fail(f"tensor {name!r} has type {kind.name}, which has no known block size")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if shape[-1] % block:
            raise cursor.fail(f"tensor {name!r} has rows of {shape[-1]} values, not whole {kind.name} blocks of {block}")
        nbytes = math.prod(shape) // block * block_bytes
        start = data_start + offset
        if offset % alignment or start + nbytes > cursor.size:
            raise cursor.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) lies outside the file "
                              "or off its alignment")
        tensors.append(TensorInfo(name, shape, kind, start, nbytes))
    ordered = sorted(tensors, key=lambda t: t.start)
    for before, after in zip(ordered, ordered[1:]):
        if before.start + before.nbytes > after.start:
            raise cursor.fail(f"tensors {before.name!r} and {after.name!r} overlap")
    return tensors
