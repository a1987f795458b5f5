"""Every tensor type the importer reads, against the `gguf` package's own dequantizer, on blocks of known values.

The blocks are made by `gguf.quants.quantize` from known float values where the package has a quantizer
(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and by hand for the K-quants (random quants and sub-block
scales under fp16 super-block scales of known size: tests/gguf_synth.py `k_blocks`). The importer's values
must be gguf's to the bit (max abs error 0), whole and read a slice of rows at a time; for the three block
types MLX reads itself, they are also MLX's own dequantization, computed in fp32.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from gguf_synth import K_LAYOUT, finish, k_blocks
from grpo_fleet.models.gguf.header import read_gguf
from grpo_fleet.models.gguf.weights import SUPPORTED_TENSOR_TYPES, dequantized

Q = GGMLQuantizationType
ROWS, COLUMNS = 12, 512  # two 256-value K blocks per row
# How far gguf's quantization of the known values may land from them, in quantization steps of each 32-value
# block (absmax / levels for the symmetric types, range / levels for those with a minimum); float types relative.
# This is gguf's quantizer's error, not the importer's: that one is 0.
STEPS = {"Q8_0": ("absmax", 127), "Q5_0": ("absmax", 16), "Q4_0": ("absmax", 8), "Q5_1": ("range", 31), "Q4_1": ("range", 15)}
RELATIVE = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}


def _known_values() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((ROWS, COLUMNS)).astype(np.float32)


def _stored(kind: GGMLQuantizationType) -> np.ndarray:
    if kind in K_LAYOUT:
        return k_blocks((ROWS, COLUMNS), kind, np.random.default_rng(int(kind)))
    return quantize(_known_values(), kind)


def _one_tensor_file(path: Path, kind: GGMLQuantizationType, data: np.ndarray) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    finish(writer)
    return path


@pytest.mark.parametrize("name", SUPPORTED_TENSOR_TYPES)
def test_each_type_reads_as_gguf_dequantizes_it(name: str, tmp_path: Path) -> None:
    kind = Q[name]
    stored = _stored(kind)
    gguf = read_gguf(_one_tensor_file(tmp_path / f"{name}.gguf", kind, stored))
    (info,) = gguf.tensors
    assert (info.type_name, info.shape) == (name, (ROWS, COLUMNS))
    reference = dequantize(stored, kind)
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    ours = dequantized(gguf, info)
    assert ours.dtype == np.float32 and np.abs(ours - reference).max() == 0.0
    sliced = np.concatenate([dequantized(gguf, info, slice(start, start + 5)) for start in range(0, ROWS, 5)])
    np.testing.assert_array_equal(sliced, reference)
    if name in STEPS or name in RELATIVE:  # the known values came through gguf's quantizer, within its own error
        assert (np.abs(reference - _known_values()) <= _allowed(name, _known_values())).all()


def _allowed(name: str, values: np.ndarray) -> np.ndarray:
    if name in RELATIVE:
        return RELATIVE[name] * np.abs(values)
    measure, levels = STEPS[name]
    blocks = values.reshape(-1, 32)
    spread = np.abs(blocks).max(axis=1) if measure == "absmax" else blocks.max(axis=1) - blocks.min(axis=1)
    return np.repeat(spread / levels, 32).reshape(values.shape) * 1.001  # fp16 scales round a little


def _mlx_dequantized(tensors: dict[str, mx.array], name: str) -> np.ndarray:
    """MLX's own reading of a Q4_0/Q4_1/Q8_0 tensor: packed weights with fp16 scales and biases, taken to fp32."""
    stem = name[: -len(".weight")]
    if f"{stem}.scales" not in tensors:
        return np.array(tensors[name].astype(mx.float32))
    packed = tensors[name]
    scales, biases = tensors[f"{stem}.scales"].astype(mx.float32), tensors[f"{stem}.biases"].astype(mx.float32)
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * 32)
    return np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))


@pytest.mark.parametrize("name", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"])
def test_the_types_mlx_reads_come_out_as_mlx_reads_them(name: str, tmp_path: Path) -> None:
    kind = Q[name]
    path = _one_tensor_file(tmp_path / f"{name}.gguf", kind, _stored(kind))
    tensors = mx.load(str(path))
    assert isinstance(tensors, dict)
    gguf = read_gguf(path)
    np.testing.assert_array_equal(dequantized(gguf, gguf.tensors[0]), _mlx_dequantized(tensors, "blk.0.ffn_up.weight"))
