"""What a GGUF's metadata says: the model family, its hyperparameters, and the config.json mlx-lm builds it from.

Every value used is checked for its type and range before anything is built from it, so a hostile file
(head_count = 0, a bos id past the vocabulary, a string where a number belongs) is one GGUFError naming
the key. Shared by the importer (importer.py), its weights (weights.py) and its tokenizer (tokenizer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


class GGUFError(ValueError):
    """A GGUF file this importer cannot turn into a model, with the reason."""


@dataclass(frozen=True)
class Family:
    """A model family: llama.cpp's architecture name, mlx-lm's model module, and how llama.cpp wrote the weights."""

    architecture: str  # general.architecture
    model_type: str  # mlx_lm.models.<model_type>, config.json's model_type
    hf_class: str  # config.json's architectures
    tokenizers: tuple[str, ...]  # tokenizer.ggml.model values this family ships with
    block_names: dict[str, str]  # GGUF block tensor stem -> Hugging Face name under model.layers.N
    permuted_qk: bool = False  # llama.cpp permutes q/k rows for its rope layout (convert_hf_to_gguf.py, LlamaModel.permute)
    norm_shift: float = 0.0  # Gemma's norms are stored as 1 + w (convert_hf_to_gguf.py, Gemma3Model); mlx-lm adds the 1 itself
    extra: dict[str, Any] = field(default_factory=dict)


_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
FAMILIES = {family.architecture: family for family in (
    Family("llama", "llama", "LlamaForCausalLM", ("gpt2", "llama"),
           _ATTENTION | {"ffn_norm": "post_attention_layernorm"}, permuted_qk=True),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", ("gpt2",), _ATTENTION | {"ffn_norm": "post_attention_layernorm"}),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", ("gpt2",),
           _ATTENTION | _QK_NORMS | {"ffn_norm": "post_attention_layernorm"}),
    Family("gemma3", "gemma3_text", "Gemma3ForCausalLM", ("llama",),
           _ATTENTION | _QK_NORMS | {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                                     "post_ffw_norm": "post_feedforward_layernorm"}, norm_shift=1.0),
)}
ARCHITECTURES = tuple(FAMILIES)


def family_of(architecture: Any) -> Family:
    # An array there (a list, or numpy's) is unhashable: looked up, it would be a TypeError, not this refusal.
    if not isinstance(architecture, str) or architecture not in FAMILIES:
        raise GGUFError(f"architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return FAMILIES[architecture]


def check_architecture(architecture: Any) -> None:
    family_of(architecture)


_MISSING: Any = object()


def _absent(metadata: dict[str, Any], key: str, default: Any) -> bool:
    """Whether `key` is missing and `default` stands for it (a default is trusted: it is not the file's)."""
    if key in metadata:
        return False
    if default is _MISSING:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return True


def meta_int(metadata: dict[str, Any], key: str, low: int, high: int, default: Any = _MISSING) -> int:
    """An integer in [low, high]; an array, a float, a bool or a string there is refused by name."""
    if _absent(metadata, key, default):
        return int(default)
    value = metadata[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"metadata {key!r} is {_shown(value)}, not an integer")
    if not low <= int(value) <= high:
        raise GGUFError(f"metadata {key!r} is {value}, outside {low}..{high}")
    return int(value)


def meta_float(metadata: dict[str, Any], key: str, low: float, high: float, default: Any = _MISSING) -> float:
    """A finite number in (low, high]."""
    if _absent(metadata, key, default):
        return float(default)
    value = metadata[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GGUFError(f"metadata {key!r} is {_shown(value)}, not a number")
    if not (math.isfinite(float(value)) and low < float(value) <= high):
        raise GGUFError(f"metadata {key!r} is {value}, outside ({low}, {high}]")
    return float(value)


def meta_str(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    if _absent(metadata, key, default):
        return str(default)
    value = metadata[key]
    if not isinstance(value, str):
        raise GGUFError(f"metadata {key!r} is {_shown(value)}, not a string")
    return value


def meta_bool(metadata: dict[str, Any], key: str, default: bool) -> bool:
    if _absent(metadata, key, default):
        return default
    value = metadata[key]
    if not isinstance(value, (bool, np.bool_)):
        raise GGUFError(f"metadata {key!r} is {_shown(value)}, not a boolean")
    return bool(value)


def _shown(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters an mlx-lm config needs, read from `<arch>.*` metadata and checked."""

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
    sliding_window: Optional[int] = None
    rope_scaling: Optional[dict[str, Any]] = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]


def read_hyper(metadata: dict[str, Any], vocab_rows: int) -> Hyper:
    """The family's shape from the metadata; `vocab_rows` is the embedding's row count (the file's real vocabulary)."""
    arch = meta_str(metadata, "general.architecture")
    family_of(arch)
    hidden = meta_int(metadata, f"{arch}.embedding_length", 1, 1 << 16)
    heads = meta_int(metadata, f"{arch}.attention.head_count", 1, 1024)
    kv_heads = meta_int(metadata, f"{arch}.attention.head_count_kv", 1, heads, heads)
    if heads % kv_heads:
        raise GGUFError(f"metadata: {heads} attention heads cannot be shared by {kv_heads} key/value heads")
    if f"{arch}.attention.key_length" not in metadata and hidden % heads:
        raise GGUFError(f"metadata: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = meta_int(metadata, f"{arch}.attention.key_length", 2, 1024, hidden // heads)
    if head_dim % 2 or meta_int(metadata, f"{arch}.attention.value_length", 2, 1024, head_dim) != head_dim:
        raise GGUFError(f"metadata: head size {head_dim} must be even and equal for keys and values")
    context = meta_int(metadata, f"{arch}.context_length", 1, 1 << 24, 4096)
    declared = meta_int(metadata, f"{arch}.vocab_size", 1, 1 << 22, vocab_rows)
    if declared != vocab_rows:
        raise GGUFError(f"metadata {arch}.vocab_size is {declared}, but token_embd has {vocab_rows} rows")
    return Hyper(
        architecture=arch, hidden_size=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        layers=meta_int(metadata, f"{arch}.block_count", 1, 1024),
        intermediate_size=meta_int(metadata, f"{arch}.feed_forward_length", 1, 1 << 20),
        vocab_size=vocab_rows,
        rms_norm_eps=meta_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 0.0, 0.1),
        rope_theta=meta_float(metadata, f"{arch}.rope.freq_base", 0.0, 1e12, 10000.0),
        context_length=context,
        sliding_window=meta_int(metadata, f"{arch}.attention.sliding_window", 1, context, 512) if arch == "gemma3" else None,
        rope_scaling=_linear_rope_scaling(metadata, arch),
    )


def _linear_rope_scaling(metadata: dict[str, Any], arch: str) -> Optional[dict[str, Any]]:
    """`<arch>.rope.scaling.type`: none or linear (Gemma 3 4B and up: linear, factor 8); anything else is refused."""
    kind = meta_str(metadata, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise GGUFError(f"rope scaling {kind!r} is not supported (supported: none, linear; Llama 3's comes as rope_freqs)")
    return {"type": "linear", "factor": meta_float(metadata, f"{arch}.rope.scaling.factor", 0.0, 1024.0)}


def check_rope_factors_shape(shape: tuple[int, ...], hyper: Hyper) -> None:
    """rope_freqs holds one factor per rotated pair: checked from the tensor table, before any byte is dequantized
    (a hostile file's could be as large as the file, and many times that as float32)."""
    if shape != (hyper.head_dim // 2,):
        raise GGUFError(f"rope_freqs has shape {shape}, not ({hyper.head_dim // 2},): one factor per rotated pair")


def llama3_rope_scaling(factors: np.ndarray, hyper: Hyper, metadata: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's `rope_scaling` for a Llama 3.x file, recovered from llama.cpp's `rope_freqs` tensor (its shape
    already checked by check_rope_factors_shape).

    llama.cpp's converter (LlamaModel.generate_extra_tensors) writes the per-frequency factors its rope
    divides by, computed from rope_scaling's factor, low/high_freq_factor and the original context, and
    no rope-scaling metadata. The factor is the largest of them; the others are Llama 3.x's (1, 4, 8192)
    unless the metadata says otherwise. The factors are then recomputed from those and must match.
    """
    if not np.all(np.isfinite(factors)) or factors.min() < 1.0:
        raise GGUFError("rope_freqs has values that are not Llama 3 rope factors")
    original = meta_int(metadata, f"{hyper.architecture}.rope.scaling.original_context_length", 1, 1 << 24, 8192)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": original}
    expected = llama3_factors(scaling, hyper.rope_theta, hyper.head_dim)
    if not np.allclose(factors, expected, rtol=1e-5, atol=0):
        raise GGUFError("rope_freqs does not follow Llama 3's rope scaling (low 1, high 4); this importer cannot map it")
    return scaling


def llama3_factors(scaling: dict[str, Any], base: float, dim: int) -> np.ndarray:
    """llama.cpp's rope factors for Llama 3 scaling, one per rotated pair."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * math.pi / freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle))


def model_config(hyper: Hyper, eos: list[int], bos: Optional[int], tied: bool) -> dict[str, Any]:
    """config.json for the family's mlx-lm model class."""
    family = hyper.family
    config: dict[str, Any] = {
        "model_type": family.model_type,
        "architectures": [family.hf_class],
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
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "bos_token_id": bos,
        "torch_dtype": "float32",
    }
    if hyper.rope_scaling is not None:
        config["rope_scaling"] = hyper.rope_scaling
    if family.architecture == "gemma3":
        config |= _gemma3_config(hyper)
    return config


def _gemma3_config(hyper: Hyper) -> dict[str, Any]:
    """What llama.cpp's gemma3 graph fixes rather than reads (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer
    global, local layers' rope base 10,000, and queries scaled by 1/sqrt(head size), by 1/sqrt(hidden / heads) for
    the 27B (62 layers)."""
    scalar = hyper.hidden_size // hyper.heads if hyper.layers == 62 else hyper.head_dim
    return {"sliding_window": hyper.sliding_window, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": scalar}
