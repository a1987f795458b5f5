"""Fused weights -> a GGUF file that llama.cpp (and so Ollama and LM Studio) reads.

The inverse of import-gguf, step by step:
- the metadata (a Header) is the source GGUF's, every key with its own type (gguf_kv.py): hyperparameters, the
  tokenizer (tokens, scores, types, merges, special ids) and the chat template come back byte for byte; only
  general.file_type (and the quantization version) say what this file holds. A model that did not come from a GGUF
  gets its metadata from its mlx-lm directory instead (hf_header.py);
- tensor names are llama.cpp's, from the `gguf` package's own name map, and each is checked to be the name the
  importer maps back to the same weight (models/gguf/weights.py: hf_name);
- what the importer undoes is redone: llama's q/k rows are permuted for llama.cpp's rope layout
  (convert_hf_to_gguf.py, LlamaModel.permute) and Gemma's norms stored as 1 + w;
- weights are quantized by the `gguf` package's quantizers (gguf.quants), norms and biases kept F32, as
  llama.cpp's converter and quantizer keep them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from grpo_fleet.export.gguf_kv import add_entry, source_metadata
from grpo_fleet.export.source import ExportError
from grpo_fleet.models.gguf.header import read_gguf
from grpo_fleet.models.gguf.metadata import Family, family_of
from grpo_fleet.models.gguf.weights import dequantized, hf_name

Q = GGMLQuantizationType
# --gguf values this module writes itself, with the type of each quantized weight and the file type that says so.
WRITTEN = {"f16": (Q.F16, LlamaFileType.MOSTLY_F16), "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
           "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0), "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
           "q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1), "q5_0": (Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
           "q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1)}
# Keys the writer sets itself (or that describe the old file's tensors, not this one's).
_REWRITTEN = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
# The writer logs every file it writes at INFO: the export says what it wrote itself.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gemma3": gguf.MODEL_ARCH.GEMMA3}


@functools.cache
def _name_map(architecture: str, layers: int) -> gguf.TensorNameMap:
    """The `gguf` package's name map for one family and depth, built once: building one formats every name of every
    block (20 ms at SmolLM2's 30 layers), once a tensor it was 5 of an export's 7 CPU seconds."""
    return gguf.get_tensor_name_map(_ARCH[architecture], layers)


def gguf_tensor_name(hf: str, family: Family, layers: int) -> str:
    """llama.cpp's name for a Hugging Face weight name, checked against the importer's own mapping back."""
    name = _name_map(family.architecture, layers).get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None or hf_name(name, family) != hf:
        raise ExportError(f"weight {hf} has no GGUF name that import-gguf maps back to it ({family.architecture})")
    return name


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rope (LlamaModel.permute): per head, halves interleaved as pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def as_llamacpp(weight: np.ndarray, name: str, family: Family, heads: int, kv_heads: int) -> np.ndarray:
    """Redo what the importer undoes for `name` (models/gguf/weights.py: plan_weights)."""
    if family.permuted_qk and name.endswith("attn_q.weight"):
        return permute_rope_rows(weight, heads)
    if family.permuted_qk and name.endswith("attn_k.weight"):
        return permute_rope_rows(weight, kv_heads)
    if family.norm_shift and name.endswith("norm.weight"):
        return weight + np.float32(family.norm_shift)
    return weight


def tensor_type(name: str, shape: tuple[int, ...], target: GGMLQuantizationType, tied: bool) -> GGMLQuantizationType:
    """F32 for norms and biases (1-D); the output head (the embedding when tied) at Q8_0 or better, as llama.cpp's
    quantizer keeps it above the 4-5 bit types; F16 for a row that is not whole blocks of the type."""
    if len(shape) == 1:
        return Q.F32
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    if head and target in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        target = Q.Q8_0
    block = gguf.GGML_QUANT_SIZES[target][0]
    return target if shape[-1] % block == 0 else Q.F16


def _encoded(weight: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == Q.F32:
        return np.ascontiguousarray(weight, dtype=np.float32)
    if kind == Q.F16:
        return weight.astype(np.float16)
    return quantize(weight, kind)


@dataclass(frozen=True)
class Header:
    """What a GGUF holds besides the weights: the family and shape its tensors are written for, its metadata
    (`add_metadata` writes every key but the file type) and the tensors that are not weights (Llama 3's rope_freqs)."""

    family: Family
    heads: int
    kv_heads: int
    layers: int
    add_metadata: Callable[[GGUFWriter], None]
    extra_tensors: tuple[tuple[str, np.ndarray], ...] = ()


def header_from_gguf(source: Path) -> Header:
    """The header of the GGUF a model was imported from: its metadata and rope_freqs, as they were."""
    metadata = source_metadata(source)
    values = {key: value for key, value, _ in metadata}
    family = family_of(values.get("general.architecture"))
    arch = family.architecture
    heads = int(values[f"{arch}.attention.head_count"])

    def add_metadata(writer: GGUFWriter) -> None:
        for key, value, key_type in metadata:
            if key not in _REWRITTEN:
                add_entry(writer, key, value, key_type)

    return Header(family, heads, int(values.get(f"{arch}.attention.head_count_kv", heads)),
                  int(values[f"{arch}.block_count"]), add_metadata, tuple(_kept_tensors(source)))


def write_gguf(weights: dict[str, mx.array], header: Header, out: Path, quant: str) -> Path:
    """The fused `weights` as a GGUF at `out`, `quant` one of WRITTEN, with `header`'s metadata and extra tensors."""
    target, file_type = WRITTEN[quant]
    tied = "lm_head.weight" not in weights
    staging = out.with_name(f".{out.name}.partial")
    writer = GGUFWriter(str(staging), header.family.architecture)
    header.add_metadata(writer)
    writer.add_file_type(int(file_type))
    if target not in (Q.F16, Q.BF16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data, kind in _tensors(weights, header, target, tied):
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    for name, data in header.extra_tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    staging.replace(out)
    return out


def _tensors(weights: dict[str, mx.array], header: Header, target: GGMLQuantizationType,
             tied: bool) -> Iterator[tuple[str, np.ndarray, GGMLQuantizationType]]:
    """(GGUF name, encoded data, type) of every weight, in llama.cpp's order: embedding, blocks, output."""
    family = header.family
    named = {gguf_tensor_name(hf, family, header.layers): hf for hf in weights}
    for name in sorted(named, key=_order):
        value = np.array(weights[named[name]].astype(mx.float32))
        value = as_llamacpp(value, name, family, header.heads, header.kv_heads)
        kind = tensor_type(name, value.shape, target, tied)
        yield name, _encoded(value, kind), kind


def _order(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if parts[0] == "token_embd" else 2, 0, name)


def _kept_tensors(source: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors of the source that are not weights (llama 3's rope_freqs), copied as they were (F32)."""
    parsed = read_gguf(source)
    for info in parsed.tensors:
        if info.name == "rope_freqs.weight":
            yield info.name, np.ascontiguousarray(dequantized(parsed, info), dtype=np.float32)

