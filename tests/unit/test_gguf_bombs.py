"""GGUFs built to exhaust memory or crash the importer: a vocabulary of pieces that extend each other, an oversized
rope_freqs, metadata of the wrong type anywhere. Each is refused in one line naming the file (an actor refuses it for
good), and nothing large is built first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from gguf_synth import (
    LLAMA3_SCALING,
    byte_level_vocab,
    k_quant_args,
    padded_spm_vocab,
    spm_vocab,
    staircase_spm_vocab,
    tiny_args,
    tiny_model,
    write_model_gguf,
)
from grpo_fleet.models.gguf import importer as gguf
from grpo_fleet.models.gguf.header import read_gguf
from grpo_fleet.models.gguf.importer import GGUFError, import_gguf

V = GGUFValueType
WRONG_TYPES: dict[str, tuple[Any, GGUFValueType]] = {
    "an array of strings": (["llama", "gemma3"], V.ARRAY), "an array of numbers": ([1, 2], V.ARRAY),
    "a string": ("x", V.STRING), "a float": (0.5, V.FLOAT32),
}
# Read when present, absent from the synthetic files: the wrong type is tried there too.
OPTIONAL_KEYS = ("general.alignment", "{arch}.attention.key_length", "{arch}.attention.value_length", "{arch}.vocab_size",
                 "{arch}.rope.scaling.type", "{arch}.rope.scaling.factor", "{arch}.attention.sliding_window",
                 "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.eot_token_id",
                 "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.scores")


def _refused_in_one_line(path: Path, out: Path) -> str:
    with pytest.raises(GGUFError) as caught:
        import_gguf(path, out)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message and not out.exists()
    return message


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_metadata_of_the_wrong_type_anywhere_is_one_line_or_an_import(family: str, tmp_path: Path) -> None:
    """A TypeError from any value (an array where a name belongs was one) would crash an actor on every restart."""
    vocab = byte_level_vocab() if family == "llama" else spm_vocab()
    args = tiny_args(family, len(vocab.tokens))
    model = tiny_model(args)
    present = read_gguf(write_model_gguf(tmp_path / "good.gguf", model, args, vocab).path).metadata
    keys = sorted(set(present) | {key.format(arch=family) for key in OPTIONAL_KEYS})
    refused = 0
    for index, (key, kind) in enumerate((key, kind) for key in keys for kind in WRONG_TYPES):
        path = write_model_gguf(tmp_path / f"{index}.gguf", model, args, vocab, overrides={key: WRONG_TYPES[kind]}).path
        try:
            import_gguf(path, tmp_path / f"out{index}")
        except GGUFError as exc:  # anything else escapes and fails the test
            assert str(path) in str(exc) and "\n" not in str(exc), (key, kind)
            refused += 1
    assert refused >= len(present)  # most keys refuse most wrong types: the loop did import the files


def test_an_architecture_array_is_refused_in_one_line(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    path = write_model_gguf(tmp_path / "arch.gguf", tiny_model(args), args, vocab,
                            overrides={"general.architecture": (["llama"], V.ARRAY)}).path
    assert "architecture ['llama'] is not supported" in _refused_in_one_line(path, tmp_path / "out")


def test_an_actor_refuses_an_architecture_array_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_fleet.actor.admission import ActorRefused, local_model_path

    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(tmp_path / "cache"))
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    (tmp_path / "models").mkdir()
    path = write_model_gguf(tmp_path / "models" / "arch.gguf", tiny_model(args), args, vocab,
                            overrides={"general.architecture": ([3, 4], V.ARRAY)}).path
    with pytest.raises(ActorRefused, match="arch.gguf.*architecture"):  # exit code REFUSED: never restarted
        local_model_path(str(path), [str(tmp_path / "models")])


@pytest.mark.parametrize("shape", [(8192, 64), (4096,), (7,)])
def test_rope_freqs_is_refused_by_its_shape_before_it_is_dequantized(shape: tuple[int, ...], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens), rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    hostile = (np.ones(shape, dtype=np.float32), GGMLQuantizationType.F32)
    path = write_model_gguf(tmp_path / "rope.gguf", tiny_model(args), args, vocab, rope_freqs=hostile).path
    dequantized: list[str] = []
    real = gguf.dequantized
    monkeypatch.setattr(gguf, "dequantized", lambda file, info, *rest: dequantized.append(info.name) or real(file, info, *rest))
    assert f"rope_freqs has shape {shape}, not (8,)" in _refused_in_one_line(path, tmp_path / "out")
    assert dequantized == []


def test_a_vocabulary_of_pieces_that_extend_each_other_is_refused_before_its_merges_are_built(tmp_path: Path) -> None:
    vocab = staircase_spm_vocab(400)  # ~21 M characters of merges, ~3,000 times the normal vocabulary's
    args = k_quant_args("gemma3", len(vocab.tokens))
    path = write_model_gguf(tmp_path / "bomb.gguf", tiny_model(args), args, vocab).path
    assert "pieces that extend each other, refused" in _refused_in_one_line(path, tmp_path / "out")
    normal = padded_spm_vocab(400)  # as many pieces, none extending another: imported
    args = k_quant_args("gemma3", len(normal.tokens))
    assert import_gguf(write_model_gguf(tmp_path / "normal.gguf", tiny_model(args), args, normal).path,
                       tmp_path / "normal").is_dir()


def test_the_bounds_leave_room_for_real_vocabularies_and_refuse_pieces_that_extend_each_other() -> None:
    from grpo_fleet.models.gguf.spm import spm_merges

    def merges(tokens: list[str]) -> list[tuple[str, str]]:
        return spm_merges(tokens, [1] * len(tokens), np.zeros(len(tokens), dtype=np.float32))

    # Pieces of 1 to 16 characters, as a real vocabulary has (Gemma 3: at most 16, 6.7 split characters per character).
    lengths = np.random.default_rng(0).integers(1, 17, size=50_000)
    assert len(merges([f"{index:x}".rjust(int(length), "z")[-int(length):] for index, length in enumerate(lengths)])) > 0
    with pytest.raises(GGUFError, match="characters of split points"):  # 1,200 pieces, each one character longer
        merges(["a" * length for length in range(1, 1201)])
    # 3,000 runs of 16, each in a character of its own: few split points each, but every one a merge.
    runs = [chr(0x4E00 + run) * length for run in range(3000) for length in range(1, 17)]
    with pytest.raises(GGUFError, match="characters of merges"):
        merges(runs)
    assert len(merges(runs[: 16 * 1000])) == 1000 * 120  # a third of them: inside the bound


def test_the_metadata_holds_a_bounded_number_of_strings_in_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short string costs ~6x its bytes as a Python object: a 50 MB file of 5 M of them took 426 MB to read."""
    from grpo_fleet.models.gguf import header as gguf_file

    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    model = tiny_model(args)
    good = write_model_gguf(tmp_path / "good.gguf", model, args, vocab).path
    strings = len(vocab.tokens) + len(vocab.merges)
    monkeypatch.setattr(gguf_file, "MAX_METADATA_STRINGS", strings)  # this file's tokens and merges, exactly
    assert import_gguf(good, tmp_path / "out").is_dir()
    padded = write_model_gguf(tmp_path / "padded.gguf", model, args, vocab,
                              overrides={"general.tags": (["one more"], V.ARRAY)}).path
    assert "past the" in _refused_in_one_line(padded, tmp_path / "padded-out")
