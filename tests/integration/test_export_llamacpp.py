"""llama.cpp itself reads what `grpo-fleet export` writes (llama-cpp-python, the `llamacpp` extra): every family
import-gguf reads, and SmolLM2-135M-Instruct with trained adapters, whose greedy continuations in llama.cpp equal
mlx-lm's on the fused model at f16 and Q8_0; Q4_K_M through llama.cpp's own quantizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from export_runs import run_from_gguf
from gguf_synth import MIXED_TYPES, byte_level_vocab, spm_vocab, tiny_args, tiny_model, write_model_gguf

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install 'grpo-fleet[llamacpp]' "
                    "(make test-deps builds it once into ~/.cache/grpo-fleet/wheels)")

from grpo_fleet.export.llamacpp_check import compare, greedy_agreement, open_gguf  # noqa: E402
from grpo_fleet.export.run import ExportRequest, export_run  # noqa: E402
from grpo_fleet.gguf import read_layout  # noqa: E402

pytestmark = pytest.mark.slow
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("architecture", FAMILIES)
def test_llamacpp_continues_every_family_as_mlx_lm_does(architecture: str, tmp_path: Path) -> None:
    from mlx_lm import load

    vocab = spm_vocab() if architecture == "gemma3" else byte_level_vocab()
    args = tiny_args(architecture, len(vocab.tokens))
    source = write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab,
                              mixed={stem: GGMLQuantizationType.F16 for stem in MIXED_TYPES}).path
    run, _ = run_from_gguf(tmp_path, source, trained=0.05)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, len(vocab.tokens) - 10, size=12).tolist() for _ in range(8)]
    for quant in ("f16", "q8_0"):
        result = export_run(ExportRequest(path=str(run), out=str(tmp_path / quant), gguf=quant))
        assert result.gguf is not None
        fused = load(str(result.mlx_dir))[0]
        llm = open_gguf(result.gguf)
        identical, _ = greedy_agreement(llm, fused, prompts, 16)
        llm.close()
        assert identical == len(prompts), (architecture, quant)


def test_smollm2_with_adapters_continues_in_llamacpp_as_in_mlx_lm(smollm2_gguf: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    from grpo_fleet.bench.export_gguf import trained_run

    run = trained_run(tmp_path / "run")
    for quant in ("f16", "q8_0"):
        result = export_run(ExportRequest(path=str(run), out=str(tmp_path / quant), gguf=quant))
        assert result.gguf is not None
        model, tokenizer = load(str(result.mlx_dir))[:2]
        agreement = compare(result.gguf, model, tokenizer, prompts=32, tokens=16)
        assert agreement.tokenizer_identical == 32, agreement.describe()
        assert agreement.identical == 32, f"{quant}: {agreement.describe()}"


def test_q4_k_m_goes_through_llamacpps_quantizer(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    args = tiny_args("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    source = write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab).path
    run, _ = run_from_gguf(tmp_path, source, trained=0.05)
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="q4_k_m"))
    assert result.gguf is not None and result.gguf.name == "step0-Q4_K_M.gguf"
    _, types = read_layout(result.gguf)
    assert "Q4_K" in types.values() and not list((tmp_path / "out").glob(".*"))  # the F16 step is gone
    open_gguf(result.gguf).close()
