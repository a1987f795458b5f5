"""Corrupt and hostile GGUF files: one clear line naming the file, no traceback, nothing written; and OUT_DIR kept.

Fuzzed with hypothesis: truncations anywhere, bytes flipped anywhere, and metadata values a hostile file could
carry (zero or huge sizes, ids past the vocabulary, the wrong type for a key). An actor given such a file refuses
it for good (exit code REFUSED, which the launcher does not restart).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_synth import MIXED_TYPES, byte_level_vocab, tiny_args, tiny_model, write_model_gguf
from grpo_fleet.models.gguf.importer import GGUFError, import_gguf

V = GGUFValueType
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    write_model_gguf(path, tiny_model(args), args, vocab, mixed=MIXED_TYPES)
    import_gguf(path, path.parent / "out")  # the untouched file imports
    return path.read_bytes()


def _outcome(data: bytes) -> tuple[str, list[str]]:
    """Import `data` as a file; ('ok' | the error line, what the import left beside the file)."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "damaged.gguf"
        source.write_bytes(data)
        try:
            import_gguf(source, Path(folder) / "out")
            result = "ok"
        except GGUFError as exc:
            result = str(exc)
            assert str(source) in result and "\n" not in result, result  # one line, naming the file
        left = sorted(entry.name for entry in Path(folder).iterdir() if entry.name not in ("damaged.gguf", "out"))
        assert result == "ok" or not (Path(folder) / "out").exists()
        return result, left


@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**9))
def test_a_truncated_file_is_one_line_and_writes_nothing(good_file: bytes, cut: int) -> None:
    result, left = _outcome(good_file[: cut % len(good_file)])
    assert result != "ok" and left == []


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0, max_value=10**9), st.integers(1, 255)), min_size=1, max_size=32),
       header_only=st.booleans())
def test_flipped_bytes_are_refused_in_one_line_or_read_as_other_weights(good_file: bytes, flips: list[tuple[int, int]],
                                                                         header_only: bool) -> None:
    data = bytearray(good_file)
    span = 4096 if header_only else len(data)  # the header and tokenizer are the first few KB: aim there half the time
    for position, mask in flips:
        data[position % span] ^= mask
    result, left = _outcome(bytes(data))
    assert left == []  # whatever happened, no staging directory was left behind


HOSTILE = {
    "head_count 0": {"llama.attention.head_count": (0, V.UINT32)},
    "head_count a string": {"llama.attention.head_count": ("four", V.STRING)},
    "head_count an array": {"llama.attention.head_count": ([4, 4], V.ARRAY)},
    "kv heads not dividing heads": {"llama.attention.head_count_kv": (3, V.UINT32)},
    "embedding_length 0": {"llama.embedding_length": (0, V.UINT32)},
    "embedding_length not the tensors'": {"llama.embedding_length": (128, V.UINT32)},
    "block_count huge": {"llama.block_count": (10**6, V.UINT32)},
    "block_count more than the tensors": {"llama.block_count": (3, V.UINT32)},
    "rms eps 0": {"llama.attention.layer_norm_rms_epsilon": (0.0, V.FLOAT32)},
    "rms eps nan": {"llama.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)},
    "rope base negative": {"llama.rope.freq_base": (-1.0, V.FLOAT32)},
    "context 0": {"llama.context_length": (0, V.UINT32)},
    "bos past the vocabulary": {"tokenizer.ggml.bos_token_id": (10**6, V.UINT32)},
    "eos past the vocabulary": {"tokenizer.ggml.eos_token_id": (2**32 - 1, V.UINT32)},
    "eos a float": {"tokenizer.ggml.eos_token_id": (2.0, V.FLOAT32)},
    "tokens not strings": {"tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY)},
    "token types short": {"tokenizer.ggml.token_type": ([1, 1], V.ARRAY)},
    "merges malformed": {"tokenizer.ggml.merges": (["nospace", "a b c"], V.ARRAY)},
    "architecture a number": {"general.architecture": (7, V.UINT32)},
    "architecture an array of names": {"general.architecture": (["llama", "llama"], V.ARRAY)},
    "architecture an array of numbers": {"general.architecture": ([1, 2], V.ARRAY)},
    "alignment not a power of two": {"general.alignment": (24, V.UINT32)},
    "rope scaling yarn": {"llama.rope.scaling.type": ("yarn", V.STRING)},
    "vocab_size not the embedding's": {"llama.vocab_size": (7, V.UINT32)},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens))
    written = write_model_gguf(tmp_path / "hostile.gguf", tiny_model(args), args, vocab, overrides=HOSTILE[case])
    result, left = _outcome(written.path.read_bytes())
    assert result != "ok" and left == [], case


def test_the_cli_answers_a_corrupt_file_with_one_line_and_status_2(good_file: bytes, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_fleet.cli.main import main

    source = tmp_path / "cut.gguf"
    source.write_bytes(good_file[: len(good_file) // 3])
    assert main(["import-gguf", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(source) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_actor_refuses_a_corrupt_gguf_for_good(good_file: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_fleet.actor.admission import ActorRefused, local_model_path
    from grpo_fleet.runtime.exit_codes import REFUSED, is_permanent

    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "models" / "flipped.gguf"
    source.parent.mkdir()
    source.write_bytes(good_file[:100] + bytes(b ^ 0xFF for b in good_file[100:140]) + good_file[140:])
    with pytest.raises(ActorRefused, match="flipped.gguf"):  # the actor's CLI exits REFUSED on this
        local_model_path(str(source), [str(source.parent)])
    assert is_permanent(REFUSED)
    assert not any(p.name.startswith("gguf-") for p in (tmp_path / "cache").iterdir())


# ----------------------------------------------------------------------------- OUT_DIR


def _import_into(good_file: bytes, folder: Path, out: Path, **kwargs: Any) -> Path:
    source = folder / "model.gguf"
    source.write_bytes(good_file)
    return import_gguf(source, out, **kwargs)


def test_an_existing_directory_it_did_not_write_is_refused_unless_forced(good_file: bytes, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(GGUFError, match="not written by import-gguf.*--force"):
        _import_into(good_file, tmp_path, out)
    assert (out / "notes.txt").read_text() == "keep me"
    _import_into(good_file, tmp_path, out, force=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()
    _import_into(good_file, tmp_path, out)  # now an import wrote it: replaced without --force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.gguf"]  # no old copy or staging left


def test_the_working_directory_and_the_ggufs_own_are_never_replaced(good_file: bytes, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work / "sub")
    for out in (Path("."), work, tmp_path):
        with pytest.raises(GGUFError, match="working directory, above it, or holds the GGUF"):
            _import_into(good_file, work / "sub", out, force=True)
    assert sorted(os.listdir(work / "sub")) == ["model.gguf"]
    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    with pytest.raises(GGUFError, match="not a directory"):
        _import_into(good_file, work / "sub", file_out, force=True)
