"""The GGUF importer on tiny files written with the `gguf` package, the way llama.cpp's converter writes them.

Each check has a reference that does not go through `grpo_fleet.models.gguf.importer`: the model the file was written
from, the `gguf` package's own dequantisation and tensor names, llama.cpp's permutation, norm shift and
rope factors, GPT-2's byte alphabet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gguf_synth import (
    K_TYPES,
    LLAMA3_SCALING,
    MIXED_TYPES,
    SPECIALS,
    byte_level_vocab,
    bytes_to_unicode,
    k_quant_args,
    llamacpp_permute,
    spm_vocab,
    tiny_args,
    tiny_model,
    write_minimal_gguf,
    write_model_gguf,
)
from grpo_fleet.models.gguf import weights as gguf_weights
from grpo_fleet.models.gguf.importer import GGUFError, import_gguf, unpermute_rope_rows

Q = GGMLQuantizationType
PROMPT = [5, 77, 265, 12, 140, 261, 9, 200]
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def _logits(model: Any, tokens: list[int]) -> np.ndarray:
    assert max(tokens) < model.args.vocab_size  # an id past the table reads whatever memory follows it
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def _vocab(architecture: str) -> Any:
    return spm_vocab() if architecture == "gemma3" else byte_level_vocab()


def _reference(args: dict[str, Any], expected: dict[str, np.ndarray]) -> Any:
    """The model rebuilt from what was written: gguf's dequantisation, q/k rows put back by inverting llama.cpp's
    permute, Gemma's stored 1 + w taken back to w."""
    weights = []
    for name, value in expected.items():
        if args["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args["num_attention_heads"]
            kv = heads if "q_proj" in name else args["num_key_value_heads"]
            order = llamacpp_permute(np.arange(value.shape[0]), heads, kv)  # permuted row i is original row order[i]
            value = value[np.argsort(order)]
        if args["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            value = value - np.float32(1.0)
        weights.append((name, mx.array(value)))
    model = tiny_model(args, seed=1)
    model.load_weights(weights)
    return model


def _prompt(args: dict[str, Any]) -> list[int]:
    return [token % args["vocab_size"] for token in PROMPT]


@pytest.mark.parametrize("architecture", FAMILIES)
def test_an_f32_file_imports_to_the_model_it_was_written_from(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = _vocab(architecture)
    args = tiny_args(architecture, len(vocab.tokens))
    original = tiny_model(args)
    written = write_model_gguf(tmp_path / "tiny.gguf", original, args, vocab)
    imported, _ = load(str(import_gguf(written.path, tmp_path / "out")))
    assert type(imported) is type(original)  # mlx-lm's own class for the family
    ours, theirs = _logits(imported, _prompt(args)), _logits(original, _prompt(args))
    if architecture == "gemma3":  # norms stored as 1 + w in fp32 and taken back: w to within 2^-24
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    else:  # every tensor F32 and the un-permutation only moves rows: the same numbers
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("architecture", FAMILIES)
def test_a_quantized_file_imports_to_what_gguf_dequantizes(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = _vocab(architecture)
    args = tiny_args(architecture, len(vocab.tokens))
    original = tiny_model(args)
    written = write_model_gguf(tmp_path / "tiny.gguf", original, args, vocab, mixed=MIXED_TYPES)
    imported, _ = load(str(import_gguf(written.path, tmp_path / "out")))
    reference = _reference(args, written.expected)
    np.testing.assert_allclose(_logits(imported, _prompt(args)), _logits(reference, _prompt(args)), rtol=0, atol=1e-5)
    # ... and the quantization really happened: 4-bit weights move the logits of the float model.
    assert np.abs(_logits(imported, _prompt(args)) - _logits(original, _prompt(args))).max() > 1e-3


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_k_quant_file_imports_to_what_gguf_dequantizes(architecture: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm import load

    vocab = _vocab(architecture)
    args = k_quant_args(architecture, len(vocab.tokens))
    written = write_model_gguf(tmp_path / "k.gguf", tiny_model(args), args, vocab, mixed=K_TYPES)
    imported, _ = load(str(import_gguf(written.path, tmp_path / "out")))
    reference = _reference(args, written.expected)
    np.testing.assert_allclose(_logits(imported, _prompt(args)), _logits(reference, _prompt(args)), rtol=0, atol=1e-5)
    # Streamed a few rows at a time (q/k a whole head at a time), the file is the same to the byte.
    monkeypatch.setattr(gguf_weights, "SLICE_BYTES", 3 * 4 * 256)
    sliced = import_gguf(written.path, tmp_path / "sliced")
    assert (sliced / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens), rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, num_attention_heads=4)
    original = tiny_model(args)
    written = write_model_gguf(tmp_path / "llama3.gguf", original, args, vocab)
    out = import_gguf(written.path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == LLAMA3_SCALING
    imported, _ = load(str(out))
    prompt = _prompt(args) * 4  # positions far enough apart for the scaled frequencies to matter
    np.testing.assert_array_equal(_logits(imported, prompt), _logits(original, prompt))
    unscaled = tiny_model(tiny_args("llama", len(vocab.tokens), rope_theta=500000.0))
    unscaled.load_weights(list(mx.load(str(out / "model.safetensors")).items()))  # type: ignore[union-attr]
    assert np.abs(_logits(unscaled, prompt) - _logits(original, prompt)).max() > 1e-4  # the scaling matters here


@pytest.mark.parametrize(("rows", "heads", "kv_heads"), [(64, 4, 4), (32, 4, 2), (192, 9, 3), (576, 9, 9)])
def test_unpermute_rope_rows_inverts_llamacpp_permute(rows: int, heads: int, kv_heads: int) -> None:
    weight = np.random.default_rng(rows).standard_normal((rows, 48)).astype(np.float32)
    permuted = llamacpp_permute(weight, heads, kv_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, kv_heads), weight)  # llama.cpp permutes k by its kv heads


def _written(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.parent.iterdir() if entry != path)


def test_an_unsupported_tensor_type_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    q8_1 = rng.integers(0, 256, size=(64, 40), dtype=np.uint8)  # Q8_1: llama.cpp's activation type, 32 per 40 bytes
    source = write_minimal_gguf(tmp_path / "q81.gguf", "llama", {
        "token_embd.weight": (rng.standard_normal((300, 64)).astype(np.float32), Q.F32),
        "blk.0.ffn_down.weight": (q8_1, Q.Q8_1),
    })
    with pytest.raises(GGUFError) as refused:
        import_gguf(source, tmp_path / "out")
    message = str(refused.value)
    assert "'blk.0.ffn_down.weight'" in message and "Q8_1" in message and "llama" in message and str(source) in message
    assert _written(source) == []


@pytest.mark.parametrize("architecture", ["gpt2", "phi3", "gemma2"])
def test_an_unsupported_architecture_is_refused_by_name(architecture: str, tmp_path: Path) -> None:
    weight = np.ones((300, 64), dtype=np.float32)
    source = write_minimal_gguf(tmp_path / "other.gguf", architecture, {"token_embd.weight": (weight, Q.F32)})
    with pytest.raises(GGUFError, match=f"architecture '{architecture}' is not supported"):
        import_gguf(source, tmp_path / "out")
    assert _written(source) == []


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    source = write_model_gguf(tmp_path / "pre.gguf", tiny_model(args), args, vocab, pre="brand-new-bpe").path
    with pytest.raises(GGUFError, match="pre-tokenizer 'brand-new-bpe' is not supported"):
        import_gguf(source, tmp_path / "out")
    assert _written(source) == []


@pytest.mark.parametrize(("architecture", "kind"), [("llama", "bert"), ("qwen3", "llama"), ("gemma3", "gpt2"), ("qwen2", "t5")])
def test_a_tokenizer_kind_the_family_does_not_use_is_refused_by_name(architecture: str, kind: str, tmp_path: Path) -> None:
    vocab = _vocab(architecture)
    vocab.kind = kind  # the vocabulary's own lists stay as they are: only the kind it claims changes
    args = tiny_args(architecture, len(vocab.tokens))
    source = write_model_gguf(tmp_path / "kind.gguf", tiny_model(args), args, vocab).path
    with pytest.raises(GGUFError, match=f"tokenizer model '{kind}' is not supported for {architecture}"):
        import_gguf(source, tmp_path / "out")
    assert _written(source) == []


def test_the_imported_tokenizer_applies_the_files_merges_and_specials(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    written = write_model_gguf(tmp_path / "tiny.gguf", tiny_model(args), args, vocab)
    tokenizer = Tokenizer.from_file(str(import_gguf(written.path, tmp_path / "out") / "tokenizer.json"))
    space = bytes_to_unicode()[ord(" ")]
    ids = vocab.tokens.index
    text = "<|im_start|>hello world the 12!<|im_end|>"
    expected = [ids("<|im_start|>"), ids("hello"), ids(space + "world"), ids(space + "the"), ids(space),
                ids("1"), ids("2"), ids("!"), ids("<|im_end|>")]  # "smollm" splits digits one by one
    assert tokenizer.encode(text).ids == expected
    assert tokenizer.decode(expected, skip_special_tokens=False) == text
    assert all(ids(special) >= 256 for special in SPECIALS)
