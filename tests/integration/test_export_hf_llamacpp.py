"""llama.cpp itself reads the GGUF `grpo-fleet export` builds for a model trained from an mlx-lm directory (no GGUF
to copy metadata from): its tokenizer gives the Hugging Face tokenizer's ids, and its logits and greedy tokens are
mlx-lm's. Tiny models of every family, and SmolLM2-135M-Instruct from its mlx-lm directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from export_runs import run_from_gguf
from gguf_synth import byte_level_vocab, spm_vocab, tiny_args, tiny_model, write_model_gguf

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install 'grpo-fleet[llamacpp]' "
                    "(make test-deps builds it once into ~/.cache/grpo-fleet/wheels)")

from grpo_fleet.export.llamacpp_check import chat_prompt, greedy_agreement, prompt_texts  # noqa: E402
from grpo_fleet.export.run import ExportRequest, export_run  # noqa: E402
from grpo_fleet.models.gguf.importer import import_gguf  # noqa: E402

pytestmark = pytest.mark.slow
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
# Plain text, digits, whitespace runs, letters beyond ASCII, and the special tokens written out.
TEXTS = ["Hello world! the 12 worlds", "  two  spaces\n\nand lines\tand tabs", "Ünïcode 中文 naïve, 3.14159 🙂",
         "<|im_start|>user\nhello<|im_end|>", "<start_of_turn>model\nthe world<end_of_turn>"]


def _llama(gguf: Path, **kwargs: Any) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=512, n_threads=1, verbose=False, **kwargs)


def _tokenizer_pairs(llm: Any, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(llama.cpp's ids, the Hugging Face tokenizer's) for each text with special tokens added, and for a chat with
    the template applied and its special tokens parsed."""
    pairs = [(llm.tokenize(text.encode(), add_bos=True, special=True), tokenizer.encode(text)) for text in TEXTS]
    chat = chat_prompt(tokenizer, TEXTS[0])
    pairs.append((llm.tokenize(chat.encode(), add_bos=False, special=True), tokenizer.encode(chat, add_special_tokens=False)))
    return pairs


@pytest.mark.parametrize("architecture", FAMILIES)
def test_llamacpp_reads_a_model_trained_from_a_directory_as_mlx_lm_does(architecture: str, tmp_path: Path) -> None:
    """The model is trained from the imported directory, so the GGUF's metadata is built from config.json and the
    tokenizer files, not copied; a wrong key (a head count, the pre-tokenizer, a token type) moves the ids or the
    logits by whole units, f16's rounding by far less (measured below 0.04 for the GGUF path)."""
    import mlx.core as mx
    from mlx_lm import load

    vocab = spm_vocab() if architecture == "gemma3" else byte_level_vocab()
    args = tiny_args(architecture, len(vocab.tokens))
    source = write_model_gguf(tmp_path / "source.gguf", tiny_model(args), args, vocab,
                              chat_template=None if architecture == "gemma3" else "chatml").path
    run, _ = run_from_gguf(tmp_path, source, model_path=str(tmp_path / "base"), trained=0.05)
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    assert result.gguf is not None
    tokenizer = load(str(result.mlx_dir))[1]
    llm = _llama(result.gguf, logits_all=True)
    for theirs, ours in _tokenizer_pairs(llm, tokenizer):
        assert theirs == ours, architecture
    prompt = np.random.default_rng(0).integers(5, len(vocab.tokens) - 10, size=24).tolist()
    same = load(str(import_gguf(result.gguf, tmp_path / "same")))[0]  # the GGUF's own weights, in mlx-lm
    ours_logits = np.array(same(mx.array([prompt]))[0].astype(mx.float32))
    llm.eval(prompt)
    theirs_logits = np.array(llm.scores[:len(prompt)])
    llm.close()
    assert np.abs(ours_logits).max() > 1.0  # logits of a size that a misread tensor would visibly change
    np.testing.assert_allclose(theirs_logits, ours_logits, rtol=0, atol=0.1, err_msg=architecture)


@pytest.mark.timeout(900)  # ~30 s of CPU; a loaded 2-core machine stretched it past 300 s of wall
def test_smollm2_trained_from_its_mlx_directory_continues_in_llamacpp_as_in_mlx_lm(smollm2_f32_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct from an mlx-lm directory (no GGUF behind the run), rank-8 adapters, f16: its real
    49,152-token vocabulary and merges through SmolLM's pre-tokenizer, then greedy tokens against mlx-lm on the fp32
    fused model. Two prompts keep it near 30 s of CPU (each greedy token costs ~40 ms a side on 2 cores)."""
    from mlx_lm import load

    from grpo_fleet.bench.export_gguf import trained_run

    run = trained_run(tmp_path / "run", model=str(smollm2_f32_dir))
    result = export_run(ExportRequest(path=str(run), out=str(tmp_path / "out"), gguf="f16"))
    assert result.gguf is not None
    fused, tokenizer = load(str(result.mlx_dir))[:2]
    llm = _llama(result.gguf)
    for theirs, ours in _tokenizer_pairs(llm, tokenizer):
        assert theirs == ours
    prompts = [list(tokenizer.encode(chat_prompt(tokenizer, text), add_special_tokens=False)) for text in prompt_texts(2)]
    identical, shared = greedy_agreement(llm, fused, prompts, 16)
    llm.close()
    # Measured 2/2 (and 4/4 over four prompts). f16's rounding can part a near-tie late in a continuation (the GGUF
    # path measured 31/32 against the fp32 fused model), so the bound leaves room for one; a GGUF read wrongly parts
    # at the first token.
    assert identical >= 1 and shared >= 16, (identical, shared)
