"""A GGUF's metadata with each value's exact GGUF type, so an export can write the source's keys back byte for byte.

grpo_fleet.models.gguf.header reads the values (checked); a scalar's type (uint32 or int32, float32 or float64) is not in the
value, so this walks the same key/value section once more and records each key's type and, for an array, its
element type. The file was already read strictly by read_gguf, so this walk trusts the lengths.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from grpo_fleet.models.gguf.header import read_gguf

V = GGUFValueType
_WIDTHS = {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4,
           V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
KeyType = tuple[GGUFValueType, Optional[GGUFValueType]]


def key_types(path: str | Path) -> dict[str, KeyType]:
    """Each metadata key's (type, element type of an array or None), in the file's order."""
    data = np.memmap(path, mode="r", dtype=np.uint8)
    view = memoryview(data)  # type: ignore[arg-type]
    _, _, count = struct.unpack_from("<IQQ", view, 4)
    pos = 24
    types: dict[str, KeyType] = {}
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", view, pos)
        key = bytes(view[pos + 8:pos + 8 + length]).decode()
        (kind,) = struct.unpack_from("<I", view, pos + 8 + length)
        pos += 12 + length
        if V(kind) == V.ARRAY:
            item, items = struct.unpack_from("<IQ", view, pos)
            pos += 12
            types[key] = (V.ARRAY, V(item))
            for _ in range(items):
                pos = _skip(view, pos, V(item))
        else:
            types[key] = (V(kind), None)
            pos = _skip(view, pos, V(kind))
    return types


def _skip(view: memoryview, pos: int, kind: GGUFValueType) -> int:
    if kind == V.STRING:
        return pos + 8 + struct.unpack_from("<Q", view, pos)[0]
    return pos + _WIDTHS[kind]


def source_metadata(path: str | Path) -> list[tuple[str, Any, KeyType]]:
    """(key, value, type) of every metadata entry of the GGUF at `path`, in its order."""
    metadata = read_gguf(path).metadata
    return [(key, metadata[key], kind) for key, kind in key_types(path).items()]


def add_entry(writer: GGUFWriter, key: str, value: Any, kind: KeyType) -> None:
    """One metadata entry as the source had it (numeric arrays as Python lists: the writer packs sequences)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    writer.add_key_value(key, value, kind[0], sub_type=kind[1])
