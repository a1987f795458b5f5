"""What a GGUF's metadata says: the architecture's hyperparameters and the config.json mlx-lm builds it from.

Shared by the importer (gguf.py) and the tokenizer it builds (gguf_tokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

ARCHITECTURES = ("llama", "qwen2")


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


def check_architecture(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in metadata:
        return scalar(metadata[key])
    if default is None:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return default


def read_hyper(metadata: dict[str, Any]) -> Hyper:
    """The architecture and its shape from the metadata; an architecture not in ARCHITECTURES is refused."""
    arch = str(meta(metadata, "general.architecture"))
    check_architecture(arch)
    hidden, heads = int(meta(metadata, f"{arch}.embedding_length")), int(meta(metadata, f"{arch}.attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size")
    return Hyper(
        architecture=arch,
        hidden_size=hidden,
        layers=int(meta(metadata, f"{arch}.block_count")),
        intermediate_size=int(meta(metadata, f"{arch}.feed_forward_length")),
        heads=heads,
        kv_heads=int(meta(metadata, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta(metadata, f"{arch}.attention.key_length", hidden // heads)),
        vocab_size=int(scalar(vocab)) if vocab is not None else len(metadata["tokenizer.ggml.tokens"]),
        rms_norm_eps=float(meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(meta(metadata, f"{arch}.context_length", 4096)),
    )


def model_config(hyper: Hyper, metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json for mlx-lm's llama / qwen2 model classes."""
    eos = int(meta(metadata, "tokenizer.ggml.eos_token_id"))
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
        "bos_token_id": int(scalar(bos)) if bos is not None else None,
        "torch_dtype": "float32",
    }
