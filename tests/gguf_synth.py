"""Tiny GGUF files written the way llama.cpp's converter writes them, for the importer's unit tests.

Everything here is an independent reference for `grpo_fleet.gguf`: the files are written with the
`gguf` package's own GGUFWriter and quantizers, the q/k permutation is llama.cpp's
(`convert_hf_to_gguf.py`, `LlamaModel.permute`), and the byte alphabet is GPT-2's `bytes_to_unicode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

Q = GGMLQuantizationType
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("the", "hello", "world", "12")  # each gets merges for itself, then for " word"

# GGUF tensor stems of a block, by the Hugging Face name they come from.
BLOCK_STEMS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL_STEMS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# A quantized type for each kind of weight, so one file holds every type the importer reads.
MIXED_TYPES = {
    "token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16,
    "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "output": Q.Q4_1,
}


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), copied as the reference."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@dataclass
class Vocab:
    tokens: list[str] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)


def byte_level_vocab() -> Vocab:
    """The 256 byte symbols, merges that build WORDS (with and without a leading space), then the specials."""
    vocab = Vocab(tokens=list(bytes_to_unicode().values()), types=[NORMAL] * 256)
    space = bytes_to_unicode()[ord(" ")]
    for word in WORDS:  # "w o", "wo r", "wor l", "worl d", then "Ġ world"
        pairs = [(word[: end - 1], word[end - 1]) for end in range(2, len(word) + 1)] + [(space, word)]
        for left, right in pairs:
            vocab.merges.append(f"{left} {right}")
            vocab.tokens.append(left + right)
            vocab.types.append(NORMAL)
    for special in SPECIALS:
        vocab.tokens.append(special)
        vocab.types.append(CONTROL)
    return vocab


def tiny_args(architecture: str, vocab_size: int) -> dict[str, Any]:
    """mlx-lm ModelArgs for a two-layer model with grouped-query attention (4 heads, 2 kv heads)."""
    return {
        "model_type": architecture, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab_size,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": architecture == "qwen2",
    }


def tiny_model(architecture: str, vocab_size: int, seed: int = 0) -> Any:
    """A random mlx-lm llama or qwen2 model; norms and biases are random too, so a swapped one shows."""
    from mlx_lm.models import llama, qwen2

    module = {"llama": llama, "qwen2": qwen2}[architecture]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**tiny_args(architecture, vocab_size)))
    randomized = [(name, 1.0 + 0.2 * mx.random.normal(value.shape) if "norm" in name or name.endswith(".bias")
                   else value) for name, value in tree_flatten(model.parameters())]
    model.load_weights(randomized)
    mx.eval(model.parameters())
    return model


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in GLOBAL_STEMS:
        return f"{GLOBAL_STEMS[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{BLOCK_STEMS[rest]}.{suffix}"


def tensor_type(name: str, mixed: bool) -> GGMLQuantizationType:
    """F32 for norms and biases (as llama.cpp writes them); with `mixed`, MIXED_TYPES for the weights."""
    stem = name.rsplit(".", 1)[0].split(".")[-1]
    if not mixed or name.endswith(".bias") or "norm" in stem:
        return Q.F32
    return MIXED_TYPES[stem]


@dataclass
class WrittenModel:
    path: Path
    # What a faithful importer must give back: each weight as gguf's own dequantisation of what was written.
    expected: dict[str, np.ndarray]


def write_model_gguf(path: Path, model: Any, architecture: str, vocab: Vocab, *, mixed: bool,
                     pre: str = "smollm", types: dict[str, GGMLQuantizationType] | None = None) -> WrittenModel:
    """Write `model` as llama.cpp's converter would: q/k rows permuted for llama, tensors of the chosen types."""
    args = tiny_args(architecture, len(vocab.tokens))
    heads, kv_heads = args["num_attention_heads"], args["num_key_value_heads"]
    writer = GGUFWriter(str(path), architecture)
    _write_hyper(writer, args)
    _write_tokenizer(writer, vocab, pre)
    expected: dict[str, np.ndarray] = {}
    for hf, value in tree_flatten(model.parameters()):
        weight = np.array(value.astype(mx.float32))
        name = gguf_name(hf)
        if architecture == "llama" and name.endswith("attn_q.weight"):
            weight = llamacpp_permute(weight, heads, heads)
        elif architecture == "llama" and name.endswith("attn_k.weight"):
            weight = llamacpp_permute(weight, heads, kv_heads)
        kind = (types or {}).get(name, tensor_type(name, mixed))
        data = weight.astype(np.float16) if kind == Q.F16 else weight if kind == Q.F32 else quantize(weight, kind)
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        stored = dequantize(data, kind) if kind not in (Q.F32, Q.F16) else data.astype(np.float32)
        expected[hf] = stored
    _finish(writer)
    return WrittenModel(path=path, expected=expected)


def write_minimal_gguf(path: Path, architecture: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A file with the given architecture name, llama-style hyperparameters and raw tensors: for refusals."""
    writer = GGUFWriter(str(path), architecture)
    _write_hyper(writer, tiny_args("llama", 256))
    _write_tokenizer(writer, byte_level_vocab(), "smollm")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    _finish(writer)
    return path


def _write_hyper(writer: GGUFWriter, args: dict[str, Any]) -> None:
    writer.add_context_length(args["max_position_embeddings"])
    writer.add_embedding_length(args["hidden_size"])
    writer.add_block_count(args["num_hidden_layers"])
    writer.add_feed_forward_length(args["intermediate_size"])
    writer.add_head_count(args["num_attention_heads"])
    writer.add_head_count_kv(args["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(args["rms_norm_eps"])
    writer.add_rope_freq_base(args["rope_theta"])
    writer.add_vocab_size(args["vocab_size"])


def _write_tokenizer(writer: GGUFWriter, vocab: Vocab, pre: str) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(vocab.tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
