"""The GGUF importer on tiny files written with the `gguf` package, the way llama.cpp's converter writes them.

Each check has a reference that does not go through `grpo_fleet.gguf`: the model the file was written
from, the `gguf` package's own dequantisation, llama.cpp's permutation, GPT-2's byte alphabet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gguf_synth import (
    SPECIALS,
    byte_level_vocab,
    bytes_to_unicode,
    llamacpp_permute,
    tiny_args,
    tiny_model,
    write_minimal_gguf,
    write_model_gguf,
)
from grpo_fleet.gguf import GGUFError, dequantized, import_gguf, read_layout, unpermute_rope_rows

Q = GGMLQuantizationType
PROMPT = [5, 77, 265, 12, 140, 261, 9, 200]


def _logits(model: Any, tokens: list[int]) -> np.ndarray:
    assert max(tokens) < model.args.vocab_size  # an id past the table reads whatever memory follows it
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def _reference(architecture: str, expected: dict[str, np.ndarray], vocab_size: int) -> Any:
    """The model rebuilt from what was written: gguf's dequantisation, q/k rows put back by inverting llama.cpp's permute."""
    args = tiny_args(architecture, vocab_size)
    weights = []
    for name, value in expected.items():
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args["num_attention_heads"]
            kv = heads if "q_proj" in name else args["num_key_value_heads"]
            order = llamacpp_permute(np.arange(value.shape[0]), heads, kv)  # permuted row i is original row order[i]
            value = value[np.argsort(order)]
        weights.append((name, mx.array(value)))
    model = tiny_model(architecture, vocab_size, seed=1)
    model.load_weights(weights)
    return model


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_an_f32_file_imports_to_the_model_it_was_written_from(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = byte_level_vocab()
    original = tiny_model(architecture, len(vocab.tokens))
    written = write_model_gguf(tmp_path / "tiny.gguf", original, architecture, vocab, mixed=False)
    imported, _ = load(str(import_gguf(written.path, tmp_path / "out")))
    # Every tensor is F32 and the un-permutation only moves rows, so the two models are the same numbers.
    np.testing.assert_array_equal(_logits(imported, PROMPT), _logits(original, PROMPT))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_quantized_file_imports_to_what_gguf_dequantizes(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = byte_level_vocab()
    original = tiny_model(architecture, len(vocab.tokens))
    written = write_model_gguf(tmp_path / "tiny.gguf", original, architecture, vocab, mixed=True)
    imported, _ = load(str(import_gguf(written.path, tmp_path / "out")))
    reference = _reference(architecture, written.expected, len(vocab.tokens))
    # Same weights to the bit (the importer dequantises in fp32 like gguf does); only the order of
    # float operations inside the two forward passes could differ, and it does not.
    np.testing.assert_allclose(_logits(imported, PROMPT), _logits(reference, PROMPT), rtol=0, atol=1e-6)
    # ... and the quantization really happened: 4-bit weights move the logits of the float model.
    assert np.abs(_logits(imported, PROMPT) - _logits(original, PROMPT)).max() > 1e-3


def test_each_tensor_type_dequantizes_as_gguf_does(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    written = write_model_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(vocab.tokens)), "llama", vocab, mixed=True)
    tensors = mx.load(str(written.path))
    assert isinstance(tensors, dict)
    _, types = read_layout(written.path)
    assert {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"} <= set(types.values())
    for hf_name, gguf_name in (("model.embed_tokens.weight", "token_embd.weight"),            # Q8_0
                               ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),  # Q4_0
                               ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),  # Q4_1
                               ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight"),  # F16
                               ("model.norm.weight", "output_norm.weight")):                 # F32
        ours = np.array(dequantized(tensors, gguf_name).astype(mx.float32))
        np.testing.assert_array_equal(ours, written.expected[hf_name], err_msg=f"{gguf_name} ({types[gguf_name]})")


@pytest.mark.parametrize(("rows", "heads", "kv_heads"), [(64, 4, 4), (32, 4, 2), (192, 9, 3), (576, 9, 9)])
def test_unpermute_rope_rows_inverts_llamacpp_permute(rows: int, heads: int, kv_heads: int) -> None:
    weight = np.random.default_rng(rows).standard_normal((rows, 48)).astype(np.float32)
    permuted = llamacpp_permute(weight, heads, kv_heads)
    assert not np.array_equal(permuted, weight)
    restored = unpermute_rope_rows(mx.array(permuted), kv_heads)  # llama.cpp permutes k by its kv heads
    np.testing.assert_array_equal(np.array(restored), weight)


def _written(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.parent.iterdir() if entry != path)


def test_an_unsupported_tensor_type_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    q4_k = rng.integers(0, 256, size=(64, 144), dtype=np.uint8)  # one 256-weight Q4_K block per row
    source = write_minimal_gguf(tmp_path / "q4k.gguf", "llama", {
        "token_embd.weight": (rng.standard_normal((256, 64)).astype(np.float32), Q.F32),
        "blk.0.ffn_down.weight": (q4_k, Q.Q4_K),
    })
    with pytest.raises(GGUFError) as refused:
        import_gguf(source, tmp_path / "out")
    message = str(refused.value)
    assert "'blk.0.ffn_down.weight'" in message and "Q4_K" in message and "llama" in message
    assert _written(source) == []


@pytest.mark.parametrize("architecture", ["gpt2", "phi3"])
def test_an_unsupported_architecture_is_refused_by_name(architecture: str, tmp_path: Path) -> None:
    weight = np.ones((256, 64), dtype=np.float32)
    source = write_minimal_gguf(tmp_path / "other.gguf", architecture, {"token_embd.weight": (weight, Q.F32)})
    with pytest.raises(GGUFError, match=f"architecture '{architecture}' is not supported"):
        import_gguf(source, tmp_path / "out")
    assert _written(source) == []


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    source = tmp_path / "pre.gguf"
    write_model_gguf(source, tiny_model("llama", len(vocab.tokens)), "llama", vocab, mixed=False, pre="brand-new-bpe")
    with pytest.raises(GGUFError, match="pre-tokenizer 'brand-new-bpe' is not supported"):
        import_gguf(source, tmp_path / "out")
    assert _written(source) == []


def test_the_imported_tokenizer_applies_the_files_merges_and_specials(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    vocab = byte_level_vocab()
    written = write_model_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(vocab.tokens)), "llama", vocab, mixed=False)
    tokenizer = Tokenizer.from_file(str(import_gguf(written.path, tmp_path / "out") / "tokenizer.json"))
    space = bytes_to_unicode()[ord(" ")]
    ids = vocab.tokens.index
    text = "<|im_start|>hello world the 12!<|im_end|>"
    expected = [ids("<|im_start|>"), ids("hello"), ids(space + "world"), ids(space + "the"), ids(space),
                ids("1"), ids("2"), ids("!"), ids("<|im_end|>")]  # "smollm" splits digits one by one
    assert tokenizer.encode(text).ids == expected
    assert tokenizer.decode(expected, skip_special_tokens=False) == text
    assert all(ids(special) >= 256 for special in SPECIALS)
