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
  chat template and the special tokens.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import blake3
import mlx.core as mx

DTYPES = ("float32", "bfloat16", "float16")
# The tensor types MLX's GGUF reader understands (mlx/io/gguf.cpp); anything else is refused by name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
ARCHITECTURES = ("llama", "qwen2")
IMPORT_FORMAT = 2  # 2: dequantised in fp32, not fp16. Bump when the output of an import changes, so cached imports are redone

# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE (the regexes of each model's tokenizer.json).
_GPT2_SPLIT = None  # ByteLevel's own GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "qwen2", "llama-bpe", "llama3")

# GGUF tensor names -> Hugging Face llama / qwen2 names (mlx-lm's own sanitize takes these).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# What a ggml token type means (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file this importer cannot turn into a model, with the reason."""


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters an mlx-lm config needs, read from `<arch>.*` metadata."""

    architecture: str
    hidden_size: int
    layers: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


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


def check_architecture(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in metadata:
        return _scalar(metadata[key])
    if default is None:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return default


def read_hyper(metadata: dict[str, Any]) -> Hyper:
    """The architecture and its shape from the metadata; an architecture not in ARCHITECTURES is refused."""
    arch = str(_meta(metadata, "general.architecture"))
    check_architecture(arch)
    hidden, heads = int(_meta(metadata, f"{arch}.embedding_length")), int(_meta(metadata, f"{arch}.attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size")
    return Hyper(
        architecture=arch,
        hidden_size=hidden,
        layers=int(_meta(metadata, f"{arch}.block_count")),
        intermediate_size=int(_meta(metadata, f"{arch}.feed_forward_length")),
        heads=heads,
        kv_heads=int(_meta(metadata, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_meta(metadata, f"{arch}.attention.key_length", hidden // heads)),
        vocab_size=int(_scalar(vocab)) if vocab is not None else len(metadata["tokenizer.ggml.tokens"]),
        rms_norm_eps=float(_meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(_meta(metadata, f"{arch}.context_length", 4096)),
    )


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


def model_config(hyper: Hyper, metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json for mlx-lm's llama / qwen2 model classes."""
    eos = int(_meta(metadata, "tokenizer.ggml.eos_token_id"))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return {
        "model_type": hyper.architecture,
        "architectures": ["LlamaForCausalLM" if hyper.architecture == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hyper.hidden_size,
        "num_hidden_layers": hyper.layers,
        "intermediate_size": hyper.intermediate_size,
        "num_attention_heads": hyper.heads,
        "num_key_value_heads": hyper.kv_heads,
        "head_dim": hyper.head_dim,
        "vocab_size": hyper.vocab_size,
        "rms_norm_eps": hyper.rms_norm_eps,
        "rope_theta": hyper.rope_theta,
        "max_position_embeddings": hyper.context_length,
        "tie_word_embeddings": tied,
        "eos_token_id": eos,
        "bos_token_id": int(_scalar(bos)) if bos is not None else None,
        "torch_dtype": "float32",
    }


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre, _GPT2_SPLIT)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` for the byte-level BPE vocabulary the metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = str(_meta(metadata, "tokenizer.ggml.model"))
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(pair.split(" ", 1)) for pair in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(_meta(metadata, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _int_list(metadata.get("tokenizer.ggml.token_type"))
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])
    return tokenizer


def _int_list(value: Any) -> list[int]:
    """An int array from the metadata (absent: empty)."""
    values = [] if value is None else mx.array(value).reshape(-1).tolist()
    return [int(x) for x in cast(list[int], values)]


def _token(metadata: dict[str, Any], key: str) -> Optional[str]:
    index = metadata.get(f"tokenizer.ggml.{key}")
    return None if index is None else str(metadata["tokenizer.ggml.tokens"][int(_scalar(index))])


def tokenizer_config(metadata: dict[str, Any], hyper: Hyper) -> dict[str, Any]:
    """tokenizer_config.json: the chat template, the special tokens and BOS/EOS handling."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": hyper.context_length,
        "add_bos_token": bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_scalar(metadata.get("tokenizer.ggml.add_eos_token", False))),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        config[name] = _token(metadata, key)
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    return config


def _with_bos(tokenizer: Any, metadata: dict[str, Any]) -> Any:
    """Prepend BOS in the tokenizer itself when the file says llama.cpp adds one (fast tokenizers ignore add_bos_token)."""
    from tokenizers import processors

    bos = _token(metadata, "bos_token_id")
    if bos is None or not bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", False))):
        return tokenizer
    bos_id = int(_scalar(metadata["tokenizer.ggml.bos_token_id"]))
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]),
    ])
    return tokenizer


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
    tokenizer = _with_bos(build_tokenizer(metadata), metadata)
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
