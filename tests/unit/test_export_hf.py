"""A GGUF for a model trained from an mlx-lm directory: the header is built from config.json and the tokenizer files
(export/hf_header.py, export/hf_vocab.py), as llama.cpp's converter builds one. The reference is a GGUF written the
way llama.cpp writes them (tests/gguf_synth.py): imported into a directory, trained from that directory, and exported,
its metadata must come back as the file had it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from export_runs import run_from_dir, run_from_gguf
from gguf_synth import LLAMA3_SCALING, byte_level_vocab, spm_vocab, tiny_args, tiny_model, write_model_gguf
from grpo_fleet.export.hf_header import header_from_hf
from grpo_fleet.export.hf_vocab import PRE_NAMES, read_hf_vocab
from grpo_fleet.export.run import ExportError, ExportRequest, export_run
from grpo_fleet.models.gguf.header import read_gguf
from grpo_fleet.models.gguf.importer import import_gguf
from grpo_fleet.models.gguf.weights import dequantized

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
# Keys that describe this file, not the model, or that the source need not have said (the writer's defaults).
FILE_KEYS = {"general.file_type", "general.quantization_version"}
TEXTS = ["hello the world 12", "  two  spaces\n\nand\tthe end", "Ünïcode 中文 naïve 🙂",
         "<|im_start|>user\nhello world<|im_end|>", "<start_of_turn>model\nthe world<end_of_turn>"]


def _source(tmp_path: Path, architecture: str, **overrides: Any) -> Path:
    vocab = spm_vocab() if architecture == "gemma3" else byte_level_vocab()
    args = tiny_args(architecture, len(vocab.tokens), **overrides)
    return write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab,
                            chat_template=None if architecture == "gemma3" else "chatml").path


def _same(left: Any, right: Any) -> bool:
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return bool(np.array_equal(np.asarray(left), np.asarray(right)))
    return bool(left == right)


def _encodings(model_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


@pytest.mark.parametrize("architecture", FAMILIES)
def test_a_model_from_a_directory_exports_the_gguf_it_was_imported_from(architecture: str, tmp_path: Path) -> None:
    """Every key the source GGUF had comes back with its value: hyperparameters, tokens, token types, merges, the
    pre-tokenizer, BOS/EOS/UNK ids and add_bos, the chat template. SentencePiece scores are the one exception: the
    directory holds merges, not scores, so the scores are rebuilt from them and must tokenize as the directory does."""
    source = _source(tmp_path, architecture)
    run, _ = run_from_gguf(tmp_path, source, model_path=str(tmp_path / "base"))  # trained from the directory
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out")))  # the default: Q8_0
    assert result.gguf is not None and result.gguf.name == "step0-Q8_0.gguf" and not result.note
    before, after = read_gguf(source).metadata, read_gguf(result.gguf).metadata
    rebuilt = {"tokenizer.ggml.scores"} if architecture == "gemma3" else set()
    differ = [key for key in before if key not in FILE_KEYS | rebuilt and not _same(before[key], after.get(key))]
    assert differ == []
    assert {info.name for info in read_gguf(source).tensors} == {info.name for info in read_gguf(result.gguf).tensors}
    assert _encodings(import_gguf(result.gguf, tmp_path / "back")) == _encodings(tmp_path / "base")
    if rebuilt:  # llama.cpp joins the best-scoring piece first: every merged piece ranks against every other as before
        merged = [i for i, token in enumerate(before["tokenizer.ggml.tokens"])
                  if len(token) > 1 and before["tokenizer.ggml.token_type"][i] == 1]
        was, now = before["tokenizer.ggml.scores"][merged], after["tokenizer.ggml.scores"][merged]
        assert np.array_equal(np.sign(np.subtract.outer(now, now)), np.sign(np.subtract.outer(was, was)))


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_the_pre_tokenizer_is_named_by_how_it_splits(pre: str, tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("qwen2", len(vocab.tokens))
    source = write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab, pre=pre).path
    assert read_hf_vocab(import_gguf(source, tmp_path / "base"), len(vocab.tokens)).pre == pre


def test_llama3_rope_scaling_becomes_llamacpps_rope_factors(tmp_path: Path) -> None:
    source = _source(tmp_path, "llama", rope_scaling=LLAMA3_SCALING)
    header = header_from_hf(import_gguf(source, tmp_path / "base"))
    parsed = read_gguf(source)
    written = dequantized(parsed, next(info for info in parsed.tensors if info.name == "rope_freqs.weight"))
    (name, factors), = header.extra_tensors
    assert name == "rope_freqs.weight" and factors.min() == 1.0 and factors.max() == 8.0
    np.testing.assert_allclose(factors, written, rtol=1e-6)


def _edited(base: Path, **changes: Any) -> Path:
    config = json.loads((base / "config.json").read_text()) | changes
    (base / "config.json").write_text(json.dumps(config))
    return base


@pytest.mark.parametrize(("architecture", "changes", "reason"), [
    ("gemma3", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar is 64, where llama.cpp's gemma3 fixes 32"),
    ("gemma3", {"sliding_window_pattern": 4}, "sliding_window_pattern is 4, where llama.cpp's gemma3 fixes 6"),
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ("llama", {"rope_traditional": True}, "rope_traditional = True"),
    ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "has no such setting"),
    ("qwen3", {"model_type": "phi3"}, "model_type 'phi3' has no GGUF export"),
    ("qwen2", {"quantization": {"group_size": 64, "bits": 4}}, "holds quantized weights"),
])
def test_what_llamacpp_cannot_run_is_refused_in_one_line(architecture: str, changes: dict[str, Any], reason: str,
                                                         tmp_path: Path) -> None:
    base = _edited(import_gguf(_source(tmp_path, architecture), tmp_path / "base"), **changes)
    with pytest.raises(ExportError, match=reason) as caught:
        header_from_hf(base)
    assert "\n" not in str(caught.value)


def test_a_tokenizer_llamacpp_has_no_counterpart_for_is_refused_or_noted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The self-built tiny model's BPE splits on "▁" with no byte fallback: neither of llama.cpp's BPE tokenizers."""
    run, _ = run_from_dir(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"no GGUF can be written for .*: tokenizer.json holds a BPE model \(byte "
                                          r"fallback: False, decoder: Metaspace\)") as caught:
        export_run(ExportRequest(path=str(run), out=str(out), gguf="q8_0"))
    assert "\n" not in str(caught.value) and not out.exists()
    with pytest.raises(ExportError, match="--ollama needs a GGUF"):
        export_run(ExportRequest(path=str(run), out=str(out), ollama="mine"))
    result = export_run(ExportRequest(path=str(run), out=str(out)))  # no --gguf: the mlx-lm directory, and why not
    assert result.gguf is None and (result.mlx_dir / "config.json").is_file()
    assert result.note.startswith("no GGUF: tokenizer.json holds a BPE model")


def test_a_full_fine_tune_from_a_directory_exports_its_own_weights(tmp_path: Path) -> None:
    run, _ = run_from_gguf(tmp_path, _source(tmp_path, "qwen3"), model_path=str(tmp_path / "base"), trained=0.25,
                           full=True)
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    assert result.gguf is not None
    parsed, original = read_gguf(result.gguf), read_gguf(tmp_path / "source.gguf")
    norm = {info.name: info for info in parsed.tensors}["output_norm.weight"]
    was = {info.name: info for info in original.tensors}["output_norm.weight"]
    assert norm.kind == GGMLQuantizationType.F32
    np.testing.assert_allclose(dequantized(parsed, norm), dequantized(original, was) + 0.25, atol=1e-6)
