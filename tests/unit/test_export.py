"""grpo-fleet export on tiny GGUFs written the way llama.cpp writes them (tests/gguf_synth.py): the round trip
import -> 0 steps -> export gives the same tensors and the same metadata bytes; trained adapters are fused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, LlamaFileType
from mlx.utils import tree_flatten

from export_runs import raw_metadata, run_from_gguf
from gguf_synth import MIXED_TYPES, byte_level_vocab, spm_vocab, tiny_args, tiny_model, write_model_gguf
from grpo_fleet.export import run as export_module
from grpo_fleet.export.gguf_writer import WRITTEN, permute_rope_rows
from grpo_fleet.export.kquant import K_QUANTS
from grpo_fleet.export.names import GGUF_TYPES, K_QUANT_TYPES, WRITTEN_TYPES
from grpo_fleet.export.run import ExportError, ExportRequest, export_run
from grpo_fleet.models.gguf.header import GGUFFile, TensorInfo, read_gguf
from grpo_fleet.models.gguf.importer import import_gguf
from grpo_fleet.models.gguf.weights import dequantized, unpermute_rope_rows

Q = GGMLQuantizationType
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
QUANTS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "f16": Q.F16}
# What says which file this is, not what model it holds: the only keys an export may change.
FILE_KEYS = ("general.file_type", "general.quantization_version")


def _source(tmp_path: Path, architecture: str, kind: GGMLQuantizationType) -> Path:
    vocab = spm_vocab() if architecture == "gemma3" else byte_level_vocab()
    args = tiny_args(architecture, len(vocab.tokens))
    types = {stem: kind for stem in MIXED_TYPES}
    return write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab, mixed=types,
                            chat_template=None if architecture == "gemma3" else "chatml").path


def _tensors(gguf: GGUFFile) -> dict[str, TensorInfo]:
    return {info.name: info for info in gguf.tensors}


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("architecture", FAMILIES)
def test_import_then_export_gives_the_same_tensors_and_metadata(architecture: str, quant: str, tmp_path: Path) -> None:
    source = _source(tmp_path, architecture, QUANTS[quant])
    run, _ = run_from_gguf(tmp_path, source)
    exported = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf=quant)).gguf
    assert exported is not None
    before, after = read_gguf(source), read_gguf(exported)
    assert set(_tensors(before)) == set(_tensors(after))
    for name, old in _tensors(before).items():
        new = _tensors(after)[name]
        expected, found = dequantized(before, old), dequantized(after, new)
        if new.kind == old.kind and old.kind != Q.F32:  # requantizing what a quantizer wrote gives its blocks back
            assert before.raw(old).tobytes() == after.raw(new).tobytes(), name
        elif new.kind == old.kind:  # F32 norms: Gemma's 1 + w went through w and back
            np.testing.assert_allclose(found, expected, rtol=0, atol=1e-6, err_msg=name)
        else:  # the output head, kept at Q8_0 under a 4-bit type: Q8_0's own error, half a step d = max|x| / 127 plus
            # the step's rounding to fp16 (2^-11 relative) times the largest quant, 127
            assert (old.kind, new.kind) == (Q.Q4_0, Q.Q8_0) and name in ("output.weight", "token_embd.weight"), name
            step = np.abs(expected.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(found - expected).reshape(-1, 32) <= (0.5 + 127 * 2**-11) * step + 1e-7), name
    old_meta, new_meta = raw_metadata(source), raw_metadata(exported)
    assert {k: v for k, v in old_meta.items() if k not in FILE_KEYS} == {k: v for k, v in new_meta.items() if k not in FILE_KEYS}
    assert read_gguf(exported).metadata["general.file_type"] == WRITTEN[quant][1]


def test_the_tokenizer_and_template_keys_are_byte_equal_and_present(tmp_path: Path) -> None:
    source = _source(tmp_path, "llama", Q.Q8_0)
    run, _ = run_from_gguf(tmp_path, source)
    exported = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"))).gguf  # the default: q8_0
    assert exported is not None and exported.name == "step0-Q8_0.gguf"
    old, new = raw_metadata(source), raw_metadata(exported)
    keys = ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre", "tokenizer.chat_template"]
    assert all(new[key] == old[key] for key in keys)


def _logits(model: Any, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens])).astype(mx.float32))


@pytest.mark.parametrize("architecture", FAMILIES)
def test_trained_adapters_are_fused_into_both_outputs(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    source = _source(tmp_path, architecture, Q.F16)
    run, policy = run_from_gguf(tmp_path, source, trained=0.05, step=7)
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    prompt = [3, 70, 261, 9, 100, 5]
    trained = _logits(policy.model, prompt)
    fused, _ = load(str(result.mlx_dir))[:2]
    np.testing.assert_allclose(_logits(fused, prompt), trained, rtol=1e-4, atol=1e-4)
    base, _ = load(str(tmp_path / "base"))[:2]
    assert np.abs(_logits(base, prompt) - trained).max() > 1e-2  # the adapters changed the model
    assert result.gguf is not None and result.gguf.name == "step7-F16.gguf"
    reimported = mx.load(str(import_gguf(result.gguf, tmp_path / "reimported") / "model.safetensors"))
    weights = dict(tree_flatten(fused.parameters()))
    assert set(reimported) == set(weights)
    for name, value in weights.items():  # the GGUF holds the fused weights, to f16's rounding
        np.testing.assert_allclose(np.array(reimported[name]), np.array(value), rtol=2**-10, atol=1e-6, err_msg=name)


def test_a_full_fine_tune_checkpoint_is_exported_as_it_is(tmp_path: Path) -> None:
    from mlx_lm import load

    source = _source(tmp_path, "qwen2", Q.F16)
    run, policy = run_from_gguf(tmp_path, source, trained=0.25, full=True)
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    assert result.gguf is not None
    prompt = [3, 70, 261, 9]
    np.testing.assert_allclose(_logits(load(str(result.mlx_dir))[0], prompt), _logits(policy.model, prompt), atol=1e-4)
    norm = read_gguf(result.gguf)
    moved = dequantized(norm, _tensors(norm)["output_norm.weight"])
    original = dequantized(read_gguf(source), _tensors(read_gguf(source))["output_norm.weight"])
    np.testing.assert_allclose(moved, original + 0.25, atol=1e-6)


def test_permute_rope_rows_is_undone_by_the_importer() -> None:
    weight = np.arange(8 * 3 * 6, dtype=np.float32).reshape(48, 3)
    permuted = permute_rope_rows(weight, 6)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 6), weight)


def test_step_picks_a_checkpoint_and_a_missing_step_lists_the_steps(tmp_path: Path) -> None:
    run, _ = run_from_gguf(tmp_path, _source(tmp_path, "qwen2", Q.Q8_0), step=4)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"no checkpoint of step 5 \(it has: 4\)"):
        export_run(ExportRequest(path=str(run), out=str(out), step=5))
    assert not out.exists()
    result = export_run(ExportRequest(path=str(run), out=str(out), step=4, gguf="q4_0"))
    assert result.gguf is not None and result.gguf.name == "step4-Q4_0.gguf"


def test_a_directory_that_is_not_a_run_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="neither a run directory") as caught:
        export_run(ExportRequest(path=str(tmp_path), out=str(tmp_path / "out")))
    assert "\n" not in str(caught.value)


def test_a_source_gguf_that_changed_since_the_import_is_refused(tmp_path: Path) -> None:
    source = _source(tmp_path, "llama", Q.Q8_0)
    run, _ = run_from_gguf(tmp_path, source)
    with open(source, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ExportError, match="digest changed"):
        export_run(ExportRequest(path=str(run), out=str(tmp_path / "out")))


def test_k_quants_without_llamacpp_are_refused_saying_how_to_get_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run, _ = run_from_gguf(tmp_path, _source(tmp_path, "llama", Q.Q8_0))
    monkeypatch.setattr(export_module, "quantizer", lambda: "")
    with pytest.raises(ExportError, match=r"q4_k_m needs llama.cpp's quantizer.*grpo-fleet\[llamacpp\]"):
        export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="q4_k_m"))
    assert not (tmp_path / "out").exists()


def test_ollama_gets_a_modelfile_with_the_runs_sampling_and_stop_tokens(tmp_path: Path) -> None:
    source = _source(tmp_path, "llama", Q.Q8_0)
    run, _ = run_from_gguf(tmp_path, source, generation={"temperature": 0.6, "top_p": 1.0})
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), ollama="my-grpo"))
    assert result.modelfile is not None and result.gguf is not None
    text = result.modelfile.read_text()
    assert text.startswith(f"FROM ./{result.gguf.name}\n")
    assert "PARAMETER temperature 0.6\n" in text and 'PARAMETER stop "<|im_end|>"' in text
    assert "<|im_start|>{{ .Role }}" in text  # ChatML, in Ollama's template language
    assert result.ollama_command == f"ollama create my-grpo -f {result.modelfile}"


def test_the_cli_lists_every_type_the_writers_write() -> None:
    assert tuple(WRITTEN) == WRITTEN_TYPES and tuple(K_QUANTS) == K_QUANT_TYPES
    assert GGUF_TYPES == WRITTEN_TYPES + K_QUANT_TYPES
    assert all(WRITTEN[name][1] != LlamaFileType.ALL_F32 for name in WRITTEN)


def test_run_config_sampling_is_read(tmp_path: Path) -> None:
    from grpo_fleet.export.source import read_source

    source = _source(tmp_path, "qwen3", Q.Q8_0)
    run, _ = run_from_gguf(tmp_path, source, generation={"temperature": 0.3, "top_p": 1.0}, step=2)
    read = read_source(run)
    assert (read.temperature, read.step, read.gguf) == (0.3, 2, source)
    assert json.loads((read.checkpoint / "grpo_fleet.json").read_text())["base_model"] == read.base_model


def test_a_run_ends_saying_how_to_export_it() -> None:
    from grpo_fleet.export.hint import export_hint

    from_gguf = export_hint("runs/my run", from_gguf=True)
    assert "grpo-fleet export 'runs/my run' --out 'runs/my run/export' --ollama NAME" in from_gguf
    assert "--ollama" not in export_hint("runs/demo", from_gguf=False)
    assert "grpo-fleet export runs/demo --out runs/demo/export" in export_hint("runs/demo", from_gguf=False)


def test_the_cli_exports_and_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_fleet.cli.main import main

    run, _ = run_from_gguf(tmp_path, _source(tmp_path, "llama", Q.Q8_0), step=3)
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--gguf", "q5_0", "--ollama", "mine"]) == 0
    out = capsys.readouterr().out
    assert f"GGUF: {tmp_path / 'out' / 'step3-Q5_0.gguf'}" in out and "ollama create mine -f" in out
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-fleet export: ") and "neither a run directory" in err and "\n" not in err
