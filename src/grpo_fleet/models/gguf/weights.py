"""A GGUF's tensors -> one safetensors file of Hugging Face-named float weights, a slice of rows at a time.

Every block type is dequantized by the `gguf` package's own dequantizers (`gguf.quants.dequantize`, the
numpy port of ggml's): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K. Any
other type is refused by name before anything is written.

Memory stays near one slice, not one model: the tensor table gives every output's name, dtype and shape up
front, so the safetensors header is written first and each tensor's bytes follow as its rows are
dequantized from the memory-mapped file (llama.cpp's q/k rows are put back a whole head at a time).
"""

from __future__ import annotations

import importlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, cast

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from grpo_fleet.models.gguf.header import GGUFFile, TensorInfo
from grpo_fleet.models.gguf.metadata import Family, GGUFError, Hyper

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SLICE_BYTES = 32 << 20  # float32 output per dequantized slice
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs.weight",)  # llama.cpp's Llama 3 rope factors: read into config.json's rope_scaling instead


@dataclass(frozen=True)
class Planned:
    """One output weight: the GGUF tensor it comes from, its Hugging Face name, and what is undone on the way."""

    source: TensorInfo
    target: str
    permute_heads: int = 0  # > 0: llama.cpp's q/k row permutation over this many heads is undone
    shift: float = 0.0  # subtracted (Gemma's norms are stored as 1 + w)


def check_tensor_types(tensors: list[TensorInfo], architecture: str) -> None:
    """Refuse a file with any tensor type outside SUPPORTED_TENSOR_TYPES, naming the first such tensor and its type."""
    for info in tensors:
        if info.type_name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"tensor {info.name!r} has type {info.type_name}, which this importer does not read ({architecture} model); "
                f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}. Re-quantize the model to one of them with "
                "llama.cpp's llama-quantize, or convert it from its original weights"
            )


def hf_name(gguf_name: str, family: Family) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in family.block_names:
        return f"model.layers.{int(parts[1])}.{family.block_names[parts[2]]}.{suffix}"
    return None


def plan_weights(tensors: list[TensorInfo], hyper: Hyper) -> list[Planned]:
    """Every tensor's place in the family's mlx-lm model, sorted by name; a tensor with no place is refused."""
    family, plan = hyper.family, []
    for info in tensors:
        if info.name in SKIPPED and family.architecture == "llama":
            continue
        target = hf_name(info.name, family)
        if target is None:
            raise GGUFError(f"tensor {info.name!r} has no place in a {family.architecture} model")
        heads = 0
        if family.permuted_qk and target.endswith(".self_attn.q_proj.weight"):
            heads = hyper.heads
        elif family.permuted_qk and target.endswith(".self_attn.k_proj.weight"):
            heads = hyper.kv_heads
        shift = family.norm_shift if target.endswith("norm.weight") else 0.0
        plan.append(Planned(info, target, heads, shift))
    return sorted(plan, key=lambda p: p.target)


def check_against_model(plan: list[Planned], config: dict[str, Any]) -> None:
    """The weights must be exactly the parameters of mlx-lm's own model for this config: same names, same shapes.

    The model is built lazily (MLX does not materialise its random initial weights), so this costs nothing.
    """
    from mlx.utils import tree_flatten

    try:
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        model = module.Model(module.ModelArgs.from_dict(config))
        parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
        expected = {name: tuple(value.shape) for name, value in parameters}
    except Exception as exc:  # mlx-lm's own checks on a config (its asserts included): the file's values, refused
        raise GGUFError(f"mlx-lm cannot build a {config['model_type']} model from this file's hyperparameters: {exc}") from None
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
    found = {planned.target: planned.source.shape for planned in plan}
    for name in sorted(set(expected) | set(found)):
        if name not in found:
            raise GGUFError(f"the file has no tensor for {name} {expected[name]}")
        if name not in expected:
            raise GGUFError(f"tensor {name} {found[name]} has no place in mlx-lm's {config['model_type']} model")
        if found[name] != expected[name]:
            raise GGUFError(f"tensor {name} has shape {found[name]}, but the metadata makes it {expected[name]}")


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows [x0 x2 .. x1 x3 ..] back from interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(gguf: GGUFFile, info: TensorInfo, rows: slice = slice(None)) -> np.ndarray:
    """Rows of one tensor as float32, through `gguf.quants.dequantize` (F32 is a view of the file)."""
    with np.errstate(all="ignore"):  # a damaged scale makes inf or NaN: refused by the caller, not warned about
        values = dequantize(gguf.raw(info, rows), info.kind)
    return values.astype(np.float32, copy=False)


def _slices(planned: Planned, head_dim: int) -> Iterator[slice]:
    """Row ranges of about SLICE_BYTES of float32 output; whole heads for a permuted tensor."""
    shape = planned.source.shape
    if len(shape) == 1:
        yield slice(None)
        return
    step = max(1, SLICE_BYTES // (4 * int(np.prod(shape[1:]))))
    if planned.permute_heads:
        step = max(head_dim, step // head_dim * head_dim)
    for start in range(0, shape[0], step):
        yield slice(start, min(start + step, shape[0]))


def _converted(gguf: GGUFFile, planned: Planned, rows: slice, head_dim: int, dtype: str) -> bytes:
    values = dequantized(gguf, planned.source, rows)
    if not np.isfinite(values).all():  # a damaged scale: refused rather than trained as NaN
        raise GGUFError(f"tensor {planned.source.name!r} ({planned.source.type_name}) holds values that are not finite")
    if planned.permute_heads:
        values = unpermute_rope_rows(values, values.shape[0] // head_dim)
    if planned.shift:
        values = values - np.float32(planned.shift)
    if dtype == "float32":
        return np.ascontiguousarray(values, dtype="<f4").tobytes()
    cast = mx.array(values).astype(getattr(mx, dtype)).view(mx.uint16)  # MLX's rounding, as mlx-lm would cast
    return np.array(cast).tobytes()


def write_safetensors(path: Path, gguf: GGUFFile, plan: list[Planned], hyper: Hyper, dtype: str) -> None:
    """One safetensors file (the layout mx.load and mlx_lm.load read), written tensor by tensor, slice by slice."""
    width = np.dtype(dtype if dtype != "bfloat16" else "float16").itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for planned in plan:
        nbytes = int(np.prod(planned.source.shape)) * width
        header[planned.target] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(planned.source.shape),
                                  "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for planned in plan:
            for rows in _slices(planned, hyper.head_dim):
                out.write(_converted(gguf, planned, rows, hyper.head_dim, dtype))
