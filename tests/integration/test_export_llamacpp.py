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

from grpo_fleet.export.llamacpp_check import compare, open_gguf  # noqa: E402
from grpo_fleet.export.run import ExportRequest, export_run  # noqa: E402
from grpo_fleet.models.gguf.importer import import_gguf, read_layout  # noqa: E402

pytestmark = pytest.mark.slow
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def _same_weights(gguf: Path, folder: Path) -> object:
    """mlx-lm's model on exactly the GGUF's weights (imported back, dequantized): llama.cpp's reading checked
    apart from what quantizing changed."""
    from mlx_lm import load

    return load(str(import_gguf(gguf, folder)))[0]


def _prompt_logits(gguf: Path, prompt: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    llm.eval(prompt)
    logits = np.array(llm.scores[:len(prompt)])
    llm.close()
    return logits


@pytest.mark.parametrize("architecture", FAMILIES)
def test_llamacpp_reads_every_family_as_mlx_lm_does(architecture: str, tmp_path: Path) -> None:
    """Tiny random models have near-ties everywhere, so llama.cpp's logits at every prompt position are compared
    (a q/k row order, a norm shift or a tensor read wrongly moves them by whole units, f16's rounding by far less)."""
    import mlx.core as mx

    vocab = spm_vocab() if architecture == "gemma3" else byte_level_vocab()
    args = tiny_args(architecture, len(vocab.tokens))
    source = write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab,
                              mixed={stem: GGMLQuantizationType.F16 for stem in MIXED_TYPES}).path
    run, _ = run_from_gguf(tmp_path, source, trained=0.05)
    prompt = np.random.default_rng(0).integers(5, len(vocab.tokens) - 10, size=24).tolist()
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    assert result.gguf is not None
    ours = np.array(_same_weights(result.gguf, tmp_path / "same")(mx.array([prompt]))[0].astype(mx.float32))
    theirs = _prompt_logits(result.gguf, prompt)
    assert np.abs(ours).max() > 1.0  # logits of a size that a misread tensor would visibly change
    # Measured: within 0.033 (qwen3), 0.029 (gemma3); llama.cpp rounds activations to f16 in its f16 products.
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=0.1, err_msg=architecture)


# f16: measured 16/16 alone and 14/16 in a fresh clone's make test (238 of 256 tokens before the first difference):
# greedy decoding parts at near-ties, so a near-tie's side is no bound; the per-family test above holds the logits to
# 0.1. Q8_0: llama.cpp rounds activations to 8 bits in its Q8_0 products, logits move by up to ~2 at the first
# positions, and near-ties go either way: measured 9/16 (23/32 over all 32), on the same weights too. Checked in one
# forward pass, the same: f16 16/16 (256/256 tokens), Q8_0 9/16 (211/256). A GGUF read wrongly agrees on none.
LEAST_IDENTICAL = {"f16": 12, "q8_0": 6}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("quant", list(LEAST_IDENTICAL))
def test_smollm2_with_adapters_continues_in_llamacpp_as_in_mlx_lm(quant: str, smollm2_gguf: Path, tmp_path: Path) -> None:
    """16 chat prompts x 16 greedy tokens: llama.cpp generating, mlx-lm on exactly the GGUF's weights checking each
    continuation in one forward pass (export/llamacpp_check.py). The full measurement, 32 prompts at four types and
    against the fp32 fused model too, is `grpo-fleet bench --full`'s export_gguf rows. One test a type, so that
    pytest-xdist runs the two at once."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from grpo_fleet.bench.export_gguf import trained_run

    run = trained_run(tmp_path / "run")
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / quant), gguf=quant))
    assert result.gguf is not None
    tokenizer = load_tokenizer(Path(result.mlx_dir))  # the exported directory's own; its model is not needed here
    agreement = compare(result.gguf, _same_weights(result.gguf, tmp_path / "same"), tokenizer, prompts=16)
    assert agreement.tokenizer_identical == 16, agreement.describe()
    assert agreement.identical >= LEAST_IDENTICAL[quant], f"{quant}: {agreement.describe()}"


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
