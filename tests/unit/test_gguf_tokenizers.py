"""Each family's tokenizer from a GGUF: SentencePiece vocabularies against Google's `sentencepiece`, and every
family's chat template rendered into a conversation that mlx-lm's tokenizer takes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_synth import byte_level_vocab, spm_vocab, tiny_args, tiny_model, write_model_gguf
from grpo_fleet.models.gguf.importer import import_gguf
from spm_reference import sentencepiece_processor

# Letters with pieces, whitespace runs (Gemma's user-defined tokens), and characters with no piece (byte fallback).
ALPHABET = "the hello world and ing re 12 abcxyz.,!?" + "  \n\n\t" + "éß東🙂"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the world"}, {"role": "user", "content": "and hello"}]
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gemma3 file with a SentencePiece vocabulary and no chat template (as Gemma 3's base models ship)."""
    folder = tmp_path_factory.mktemp("gemma")
    vocab = spm_vocab()
    args = tiny_args("gemma3", len(vocab.tokens))
    written = write_model_gguf(folder / "gemma.gguf", tiny_model(args), args, vocab, chat_template=None)
    return import_gguf(written.path, folder / "out")


@pytest.fixture(scope="module")
def reference() -> Any:
    vocab = spm_vocab()
    return sentencepiece_processor(vocab.tokens, vocab.types, vocab.scores, add_dummy_prefix=False,
                                   unk_id=vocab.tokens.index("<unk>"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(text: str, gemma_dir: Path, reference: Any) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == reference.EncodeAsIds(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_sentencepiece_tokenizer_adds_bos_and_merges_by_score(gemma_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load

    vocab = spm_vocab()
    wrapped = load(gemma_dir)
    ids = wrapped.encode("the hello  world")
    assert ids[0] == vocab.tokens.index("<bos>")  # llama.cpp adds BOS to a SentencePiece vocabulary that asks
    assert [vocab.tokens[i] for i in ids[1:]] == ["t", "he", "▁hello", "  ", "world"]  # "  ": Gemma's user-defined run
    assert isinstance(wrapped.detokenizer, SPMStreamingDetokenizer)  # mlx-lm's streaming decoder for this shape


def _family_dir(architecture: str, folder: Path) -> tuple[Path, Any]:
    if architecture == "gemma3":
        vocab, template = spm_vocab(), None  # no template in the file: the family's own is written
    elif architecture == "llama":
        vocab, template = byte_level_vocab(extra_specials=LLAMA3_SPECIALS), LLAMA3_TEMPLATE
    else:
        vocab, template = byte_level_vocab(), "chatml"
    args = tiny_args(architecture, len(vocab.tokens))
    written = write_model_gguf(folder / f"{architecture}.gguf", tiny_model(args), args, vocab, chat_template=template,
                               pre="llama-bpe" if architecture == "llama" else "qwen2")
    return import_gguf(written.path, folder / architecture), vocab


# The tokens that mark a turn in each family's format: each must come out as one id, not as pieces of text.
TURN_MARKS = {"llama": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "qwen2": ("<|im_start|>", "<|im_end|>"),
              "qwen3": ("<|im_start|>", "<|im_end|>"), "gemma3": ("<start_of_turn>", "<end_of_turn>")}


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma3"])
def test_each_familys_template_renders_a_conversation_mlx_lm_takes(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    model_dir, vocab = _family_dir(architecture, tmp_path)
    model, tokenizer = load(str(model_dir))
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert all(turn["content"] in text for turn in CONVERSATION)
    for mark in TURN_MARKS[architecture]:
        assert vocab.tokens.index(mark) in ids, mark
    assert max(ids) < model.args.vocab_size
    # A turn ends generation: the family's end-of-turn token is one of mlx-lm's stop tokens.
    assert vocab.tokens.index(TURN_MARKS[architecture][-1]) in tokenizer.eos_token_ids


def test_gemma_template_opens_the_first_user_turn_with_the_system_message(gemma_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    rendered = load(gemma_dir).apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nhello world<end_of_turn>\n<start_of_turn>model\n"
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["eos_token_id"] == [spm_vocab().tokens.index("<eos>"), spm_vocab().tokens.index("<end_of_turn>")]


def test_byte_level_file_without_template_gets_none(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("qwen3", len(vocab.tokens))
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        written = write_model_gguf(Path(folder) / "q.gguf", tiny_model(args), args, vocab, chat_template=None)
        settings_json = json.loads((import_gguf(written.path, Path(folder) / "out") / "tokenizer_config.json").read_text())
    assert "chat_template" not in settings_json  # no family default is invented for a byte-level family
