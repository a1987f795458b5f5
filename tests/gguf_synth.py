"""Tiny GGUF files written the way llama.cpp's converter writes them, for the importer's unit tests.

Everything here is an independent reference for `grpo_fleet.models.gguf.importer`: the files are written with the `gguf`
package's own GGUFWriter, tensor-name map and quantizers; the q/k permutation, Gemma's norm shift and Llama 3's
rope factors are llama.cpp's (`convert_hf_to_gguf.py`: `LlamaModel.permute`, `Gemma3Model.modify_tensors`,
`LlamaModel.generate_extra_tensors`); the byte alphabet is GPT-2's `bytes_to_unicode`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

Q = GGMLQuantizationType
CONTROL, NORMAL, USER_DEFINED, BYTE, UNKNOWN = 3, 1, 4, 6, 2  # llama.cpp's token types
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("the", "hello", "world", "12")  # each gets merges for itself, then for " word"
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
        "gemma3": gguf.MODEL_ARCH.GEMMA3}
# A quantized type for each kind of weight, so one file holds several types (the 32-wide ones fit a 64-wide model).
MIXED_TYPES = {
    "token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.F16,
    "ffn_gate": Q.Q5_1, "ffn_up": Q.BF16, "ffn_down": Q.Q8_0, "output": Q.Q4_1,
}
# The K-quants: 256-value blocks, so they need a model at least 256 wide (k_quant_args).
K_TYPES = {"token_embd": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q3_K,
           "ffn_gate": Q.Q2_K, "ffn_up": Q.Q4_K, "output": Q.Q5_K}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), copied as the reference."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llamacpp_rope_factors(scaling: dict[str, Any], base: float, dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3 rope scaling (LlamaModel.generate_extra_tensors), copied as the reference."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = 8192  # the converter reads hparams' original_max_position_embeddings, absent in Llama 3.x
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


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
    scores: list[float] = field(default_factory=list)
    kind: str = "gpt2"


def byte_level_vocab(extra_specials: tuple[str, ...] = ()) -> Vocab:
    """The 256 byte symbols, merges that build WORDS (with and without a leading space), then the specials."""
    vocab = Vocab(tokens=list(bytes_to_unicode().values()), types=[NORMAL] * 256)
    space = bytes_to_unicode()[ord(" ")]
    for word in WORDS:  # "w o", "wo r", "wor l", "worl d", then "Ġ world"
        pairs = [(word[: end - 1], word[end - 1]) for end in range(2, len(word) + 1)] + [(space, word)]
        for left, right in pairs:
            vocab.merges.append(f"{left} {right}")
            vocab.tokens.append(left + right)
            vocab.types.append(NORMAL)
    for special in SPECIALS + extra_specials:
        vocab.tokens.append(special)
        vocab.types.append(CONTROL)
    return vocab


SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
SPM_USER_DEFINED = ("\n", "\n\n", "  ", "   ", "    ")  # Gemma's: whitespace runs, stored with real spaces
SPM_MERGES = ("▁ t", "h e", "▁t he", "l l", "e ll", "h ell", "hell o", "▁ hello", "o r", "w or", "l d", "wor ld",
              "▁ world", "a n", "▁ an", "an d", "▁an d", "▁ a", "i n", "▁ in", "▁in g", "r e", "▁ re", "1 2", "▁ 12")


def spm_vocab() -> Vocab:
    """A SentencePiece BPE vocabulary as llama.cpp writes Gemma's: specials, user-defined whitespace, the 256 byte
    pieces, single characters, then merged pieces scored by merge order (the first merge best)."""
    vocab = Vocab(kind="llama")
    for token in SPM_SPECIALS:
        vocab.tokens.append(token)
        vocab.types.append(UNKNOWN if token == "<unk>" else CONTROL)
    for token in SPM_USER_DEFINED:
        vocab.tokens.append(token)
        vocab.types.append(USER_DEFINED)
    vocab.tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    vocab.types += [BYTE] * 256
    vocab.scores = [-1000.0] * len(SPM_SPECIALS + SPM_USER_DEFINED) + [0.0] * 256
    for char in "▁abcdefghijklmnopqrstuvwxyz.,!?0123456789":
        vocab.tokens.append(char)
        vocab.types.append(NORMAL)
        vocab.scores.append(-1000.0 + len(vocab.tokens))  # characters rank below every merged piece
    for rank, merge in enumerate(SPM_MERGES):
        vocab.tokens.append(merge.replace(" ", ""))
        vocab.types.append(NORMAL)
        vocab.scores.append(-float(rank))
    return vocab


def staircase_spm_vocab(pieces: int, char: str = "a") -> Vocab:
    """spm_vocab with `pieces` more normal pieces that extend each other (char * 2, char * 3, ...): each has a split
    at every point, into two pieces, so the merges hold about pieces**3 / 3 characters (a vocabulary bomb)."""
    vocab = spm_vocab()
    vocab.tokens += [char * length for length in range(2, pieces + 2)]
    vocab.types += [NORMAL] * pieces
    vocab.scores += [-float(length) for length in range(2, pieces + 2)]
    return vocab


def padded_spm_vocab(pieces: int) -> Vocab:
    """spm_vocab with `pieces` more normal pieces of six characters, as many as staircase_spm_vocab adds."""
    vocab = spm_vocab()
    vocab.tokens += [f"{index:06d}" for index in range(pieces)]
    vocab.types += [NORMAL] * pieces
    vocab.scores += [-float(index) for index in range(pieces)]
    return vocab


# Where a K-quant block keeps its fp16 scale d (and minimum scale dmin), by byte offset (ggml-common.h's block_qN_K).
K_LAYOUT = {Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}


def k_blocks(shape: tuple[int, ...], kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """K-quant blocks built by hand (the gguf package has no K-quantizer): random quants and sub-block scales,
    and fp16 super-block scales of known size, so the values they stand for are those gguf dequantizes to."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, block_bytes), dtype=np.uint8)
    d_at, dmin_at = K_LAYOUT[kind]
    for offset, size in ((d_at, 0.002), (dmin_at, 0.001)):
        if offset is not None:
            scale = (size * rng.uniform(0.5, 1.5, size=blocks.shape[0])).astype(np.float16)
            blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * block_bytes)


def tiny_args(architecture: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """mlx-lm ModelArgs for a small model with grouped-query attention (4 heads, 2 kv heads) of each family."""
    args: dict[str, Any] = {
        "model_type": architecture, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab_size,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": architecture != "llama",
    }
    if architecture == "qwen3":
        args |= {"head_dim": 24}  # not hidden / heads: the file must say it (key_length)
    if architecture == "gemma3":
        # 6 layers: five sliding-window layers and one global; a window of 4 so an 8-token prompt needs it.
        args |= {"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 32, "rms_norm_eps": 1e-6,
                 "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32, "sliding_window": 4,
                 "sliding_window_pattern": 6}
    return args | overrides


def k_quant_args(architecture: str, vocab_size: int) -> dict[str, Any]:
    """256 wide, so every weight is whole K-quant blocks."""
    wide = {"head_dim": 64, "query_pre_attn_scalar": 64} if architecture == "gemma3" else {}
    return tiny_args(architecture, vocab_size, hidden_size=256, intermediate_size=512, tie_word_embeddings=False, **wide)


def tiny_model(args: dict[str, Any], seed: int = 0) -> Any:
    """A random mlx-lm model of these args; norms and biases are random too, so a swapped one shows."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{args['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(args))
    if args["model_type"] == "gemma3_text" and args.get("tie_word_embeddings", True):
        model.sanitize({})  # mlx-lm ties Gemma's head when the weights have none
    randomized = [(name, 0.2 * mx.random.normal(value.shape) + (1.0 if "norm" in name else 0.0)
                   if "norm" in name or name.endswith(".bias") else value) for name, value in tree_flatten(model.parameters())]
    model.load_weights(randomized)
    mx.eval(model.parameters())
    return model


@functools.cache
def _name_map(architecture: str, layers: int) -> gguf.TensorNameMap:
    """Built once a family and depth: building one formats every name of every block (the per-tensor rebuild was
    most of test_gguf_bombs' minute)."""
    return gguf.get_tensor_name_map(ARCH[architecture], layers)


def gguf_name(hf_name: str, architecture: str, layers: int) -> str:
    """The GGUF name llama.cpp gives a Hugging Face tensor (the gguf package's tensor-name map)."""
    name = _name_map(architecture, layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    return name


def tensor_type(name: str, mixed: Optional[dict[str, GGMLQuantizationType]]) -> GGMLQuantizationType:
    """F32 for norms and biases (as llama.cpp writes them); with `mixed`, its type for each kind of weight."""
    stem = name.rsplit(".", 1)[0].split(".")[-1]
    if mixed is None or name.endswith(".bias") or "norm" in stem:
        return Q.F32
    return mixed.get(stem, Q.Q8_0)


@dataclass
class WrittenModel:
    path: Path
    # What a faithful importer must give back: each weight as gguf's own dequantisation of what was written.
    expected: dict[str, np.ndarray]


def write_model_gguf(path: Path, model: Any, args: dict[str, Any], vocab: Vocab, *,
                     mixed: Optional[dict[str, GGMLQuantizationType]] = None, pre: str = "smollm",
                     chat_template: Optional[str] = "chatml", extra: Optional[dict[str, Any]] = None,
                     overrides: Optional[dict[str, tuple[Any, gguf.GGUFValueType]]] = None,
                     rope_freqs: Optional[tuple[np.ndarray, GGMLQuantizationType]] = None) -> WrittenModel:
    """Write `model` as llama.cpp's converter would: q/k rows permuted for llama, Gemma's norms as 1 + w.
    `rope_freqs`: raw data of a type, written as that tensor instead of the factors (a hostile one)."""
    architecture = "gemma3" if args["model_type"] == "gemma3_text" else args["model_type"]
    writer = GGUFWriter(str(path), architecture)
    write_hyper(writer, args)
    write_tokenizer(writer, vocab, pre, chat_template)
    for key, value in (extra or {}).items():
        _add(writer, key, value)
    for key, (value, kind) in (overrides or {}).items():  # a value replaced, of any type: hostile metadata
        writer.kv_data[0][key] = gguf.GGUFValue(value=value, type=kind, sub_type=_sub_type(value))
    expected: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(len(str(path)))
    for hf, value in tree_flatten(model.parameters()):
        weight = np.array(value.astype(mx.float32))
        name = gguf_name(hf, architecture, args["num_hidden_layers"])
        weight = _as_llamacpp_writes(weight, name, architecture, args)
        kind = tensor_type(name, mixed)
        data = quantize(weight, kind) if kind not in K_LAYOUT else k_blocks(weight.shape, kind, rng)
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        expected[hf] = dequantize(data, kind).astype(np.float32)
    if rope_freqs is not None:
        data, kind = rope_freqs
        writer.add_tensor("rope_freqs.weight", data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    elif args.get("rope_scaling"):
        head_dim = args.get("head_dim") or args["hidden_size"] // args["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llamacpp_rope_factors(args["rope_scaling"], args["rope_theta"], head_dim))
    finish(writer)
    return WrittenModel(path=path, expected=expected)


def _as_llamacpp_writes(weight: np.ndarray, name: str, architecture: str, args: dict[str, Any]) -> np.ndarray:
    heads, kv_heads = args["num_attention_heads"], args["num_key_value_heads"]
    if architecture == "llama" and name.endswith("attn_q.weight"):
        return llamacpp_permute(weight, heads, heads)
    if architecture == "llama" and name.endswith("attn_k.weight"):
        return llamacpp_permute(weight, heads, kv_heads)
    if architecture == "gemma3" and name.endswith("norm.weight"):
        return weight + 1.0
    return weight


def write_minimal_gguf(path: Path, architecture: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A file with the given architecture name, llama-style hyperparameters and raw tensors: for refusals."""
    writer = GGUFWriter(str(path), architecture)
    write_hyper(writer, tiny_args("llama", 300))
    write_tokenizer(writer, byte_level_vocab(), "smollm", "chatml")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    finish(writer)
    return path


def write_hyper(writer: GGUFWriter, args: dict[str, Any]) -> None:
    writer.add_context_length(args["max_position_embeddings"])
    writer.add_embedding_length(args["hidden_size"])
    writer.add_block_count(args["num_hidden_layers"])
    writer.add_feed_forward_length(args["intermediate_size"])
    writer.add_head_count(args["num_attention_heads"])
    writer.add_head_count_kv(args["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(args["rms_norm_eps"])
    writer.add_rope_freq_base(args["rope_theta"])
    if "head_dim" in args:
        writer.add_key_length(args["head_dim"])
        writer.add_value_length(args["head_dim"])
    if "sliding_window" in args:
        writer.add_sliding_window(args["sliding_window"])


CHAT_TEMPLATES = {
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


def write_tokenizer(writer: GGUFWriter, vocab: Vocab, pre: str, chat_template: Optional[str]) -> None:
    writer.add_tokenizer_model(vocab.kind)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if not vocab.scores:  # byte-level BPE
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(vocab.merges)
        writer.add_bos_token_id(vocab.tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(vocab.tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)
    else:
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(vocab.scores)
        writer.add_bos_token_id(vocab.tokens.index("<bos>"))
        writer.add_eos_token_id(vocab.tokens.index("<eos>"))
        writer.add_unk_token_id(vocab.tokens.index("<unk>"))
        writer.add_pad_token_id(vocab.tokens.index("<pad>"))
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(CHAT_TEMPLATES.get(chat_template, chat_template))


def _sub_type(value: Any) -> Optional[gguf.GGUFValueType]:
    if not isinstance(value, list) or not value:
        return None
    return gguf.GGUFValueType.STRING if isinstance(value[0], str) else gguf.GGUFValueType.INT32


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
