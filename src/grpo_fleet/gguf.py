"""GGUF file -> mlx-lm model directory.

A GGUF (llama.cpp's format) holds the weights, the hyperparameters and the
tokenizer in one file. `import_gguf` turns one into a directory that
`mlx_lm.load` reads, the path every model in this project takes:

- tensors come from `mx.load` (which reads Q4_0, Q4_1 and Q8_0 blocks as MLX
  affine-quantized arrays) and are dequantised with `mx.dequantize`;
- tensor types are read with the `gguf` package, so a type MLX cannot read is
  refused by name before anything is written;
- the byte-level BPE tokenizer is built with `tokenizers` from the vocabulary,
  merges and token types in the metadata; `tokenizer_config.json` carries the
  chat template and the special tokens (gguf_tokenizer.py);
- the hyperparameters and config.json come from the metadata (gguf_metadata.py).

llama.cpp permutes the rows of a llama model's q and k projections for its rope
layout (`convert_hf_to_gguf.py`, `LlamaModel.permute`); they are put back here so
mlx-lm's rope sees the layout the model was trained with.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, cast

import blake3
import mlx.core as mx

from grpo_fleet.gguf_metadata import GGUFError, Hyper, check_architecture, model_config, read_hyper
from grpo_fleet.gguf_tokenizer import build_tokenizer, tokenizer_config, with_bos

DTYPES = ("float32", "bfloat16", "float16")
# The tensor types MLX's GGUF reader understands (mlx/io/gguf.cpp); anything else is refused by name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
IMPORT_FORMAT = 2  # 2: dequantised in fp32, not fp16. Bump when the output of an import changes, so cached imports are redone

# GGUF tensor names -> Hugging Face llama / qwen2 names (mlx-lm's own sanitize takes these).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
def file_digest(path: str | Path) -> str:
    """BLAKE3 of the file's bytes: the key of an import in a cache."""
    digest = blake3.blake3()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_gguf_path(path: str) -> bool:
    return path.lower().endswith(".gguf")


def read_layout(path: str | Path) -> tuple[str, dict[str, str]]:
    """The architecture and each tensor's ggml type name, read with the `gguf` package.

    MLX's reader does not report tensor types and fails on the ones it cannot read, so the file is
    checked with this before MLX opens it.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = str(field.contents()) if field is not None else "unknown"
    return architecture, {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}


def check_tensor_types(types: dict[str, str], architecture: str) -> None:
    """Refuse a file with any tensor type MLX cannot read, naming the first such tensor and its type."""
    for name, kind in types.items():
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"tensor {name!r} has type {kind}, which MLX cannot read ({architecture} model); "
                f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}. Re-quantize the model to one of them "
                "with llama.cpp's llama-quantize, or convert it from its original weights"
            )


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face parameter name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rope_rows(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation: per head, rows [x0 x2 .. x1 x3 ..] back from interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensors: dict[str, mx.array], name: str) -> mx.array:
    """One weight as a float array: quantized blocks (weight + scales + biases) go through mx.dequantize."""
    stem = name[: -len(".weight")] if name.endswith(".weight") else None
    if stem is None or f"{stem}.scales" not in tensors:
        return tensors[name]
    # MLX keeps the blocks' fp16 scales and minimums as fp16; dequantising in fp16 would round most weights
    # (d * q needs up to 19 bits of mantissa for Q8_0). In fp32 every product and sum is exact, as in llama.cpp.
    packed = tensors[name]
    scales, biases = tensors[f"{stem}.scales"].astype(mx.float32), tensors[f"{stem}.biases"].astype(mx.float32)
    group_size = 32  # every block type MLX reads has 32 weights per block
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * group_size)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def convert_weights(tensors: dict[str, mx.array], hyper: Hyper, dtype: str) -> dict[str, mx.array]:
    """GGUF tensors -> Hugging Face named float weights of `dtype`, q/k rows put back for llama."""
    out: dict[str, mx.array] = {}
    for name in tensors:
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in tensors:
            continue
        target = hf_name(name)
        if target is None:
            if name.startswith("rope_freqs"):  # llama.cpp's precomputed llama-3 rope factors; mlx-lm derives its own
                continue
            raise GGUFError(f"tensor {name!r} has no place in a {hyper.architecture} model")
        weight = dequantized(tensors, name).astype(mx.float32)
        if hyper.architecture == "llama" and ".self_attn.q_proj." in target:
            weight = unpermute_rope_rows(weight, hyper.heads)
        elif hyper.architecture == "llama" and ".self_attn.k_proj." in target:
            weight = unpermute_rope_rows(weight, hyper.kv_heads)
        out[target] = weight.astype(getattr(mx, dtype))
    return out


def import_gguf(source: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write an mlx-lm directory for the GGUF at `source` into `out_dir` (atomically: all of it or nothing)."""
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source, out_dir = Path(source), Path(out_dir)
    if not source.is_file():
        raise GGUFError(f"no GGUF file at {source}")
    architecture, types = read_layout(source)
    check_architecture(architecture)
    check_tensor_types(types, architecture)
    tensors, metadata = _load(source)
    hyper = read_hyper(metadata)
    weights = convert_weights(tensors, hyper, dtype)
    tokenizer = with_bos(build_tokenizer(metadata), metadata)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        config = model_config(hyper, metadata, tied="lm_head.weight" not in weights) | {"torch_dtype": dtype}
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata, hyper), indent=2) + "\n")
        (staging / "gguf_source.json").write_text(json.dumps(
            {"file": source.name, "blake3": file_digest(source), "dtype": dtype, "format": IMPORT_FORMAT}, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _load(source: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """MLX's read of a file whose architecture and tensor types were already checked."""
    try:
        loaded = mx.load(str(source), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(f"MLX could not read {source}: {exc}") from exc
    tensors, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    return dict(tensors), dict(metadata)


def cached_import(source: str | Path, cache_root: str | Path, *, dtype: str = "float32") -> Path:
    """The import of `source` under `cache_root`, keyed by the file's digest and the dtype; imported once."""
    digest = file_digest(source)
    target = Path(cache_root) / f"gguf-{digest[:24]}-{dtype}-v{IMPORT_FORMAT}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two actors on one machine share the cache: the second waits for the first import and reuses it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = target / "gguf_source.json"
        if marker.exists() and json.loads(marker.read_text()).get("blake3") == digest:
            return target
        return import_gguf(source, target, dtype=dtype)
