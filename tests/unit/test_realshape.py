"""Real-shape models: Qwen2.5-0.5B-Instruct's architecture and vocabulary, built locally, 4-bit through
mlx-lm, and dequantised for compute on the CPU backend."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from grpo_fleet.config import LoraConfig, RunConfig
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.models.loading import (
    Policy,
    digest_bytes,
    load_policy,
    load_weight_blob,
    model_digest,
    trainable_weights,
    weights_to_bytes,
)
from grpo_fleet.models.quant import cast_floating, is_quantized
from grpo_fleet.models.realshape import (
    RealShapeSpec,
    build_realshape,
    init_model,
    model_config,
    parse_spec,
    spec_from_key,
)
from grpo_fleet.models.synthetic_tokenizer import QWEN_SPECIALS
from grpo_fleet.tasks import build_task
from grpo_fleet.tasks.prompts import encode_prompt

# Each builds or loads a model with the real 151,936-token vocabulary: in `make test`, not `make test-fast`.
pytestmark = pytest.mark.slow

VOCAB = 151_936
LORA = LoraConfig(enabled=True, rank=4)


@pytest.fixture(scope="module")
def loaded(realshape_model_dir: Path) -> tuple[nn.Module, Any]:
    """One mlx_lm.load of the bf16 model for the module (the tokenizer alone takes seconds to load)."""
    return mlx_lm.load(str(realshape_model_dir))


def test_spec_parses_options_and_keys_the_cache():
    spec = parse_spec("realshape:qwen2.5-0.5b?layers=4&bits=4")
    assert spec == RealShapeSpec(layers=4, bits=4)
    assert spec.key() == "qwen2.5-0.5b-l4-s0-q4g64-v1"
    assert parse_spec("realshape:qwen2.5-0.5b").key() == "qwen2.5-0.5b-l24-s0-bf16-v1"
    for bad in ("realshape:llama-7b", "realshape:qwen2.5-0.5b?layer=2", "realshape:qwen2.5-0.5b?layers=25",
                "realshape:qwen2.5-0.5b?bits=7", "realshape:qwen2.5-0.5b?layers=1&layers=2", "tiny"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_loads_with_qwen25_05b_architecture(loaded):
    model, _ = loaded
    args = model.args
    assert (args.model_type, args.hidden_size, args.intermediate_size) == ("qwen2", 896, 4864)
    assert (args.num_attention_heads, args.num_key_value_heads, args.vocab_size) == (14, 2, VOCAB)
    assert args.tie_word_embeddings and args.rope_theta == 1e6 and args.rms_norm_eps == 1e-6
    assert args.max_position_embeddings == 32768 and args.num_hidden_layers == len(model.layers) == 1
    assert model.model.embed_tokens.weight.shape == (VOCAB, 896)
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16  # as published
    assert model_config(parse_spec("realshape:qwen2.5-0.5b"))["num_hidden_layers"] == 24


def test_every_id_decodes_and_specials_keep_qwens_ids(loaded):
    _, tokenizer = loaded
    hf = tokenizer._tokenizer
    assert len(hf) == VOCAB
    assert None not in hf.convert_ids_to_tokens(list(range(VOCAB)))
    assert len(hf.decode(list(range(VOCAB)), skip_special_tokens=False)) > VOCAB
    for offset, name in enumerate(QWEN_SPECIALS):
        assert hf.convert_tokens_to_ids(name) == 151643 + offset
    assert 151645 in tokenizer.eos_token_ids  # <|im_end|> ends a chat turn, as in Qwen
    text = "Reverse 123 -> 321, naïve café!\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_qwen_turns(loaded):
    _, tokenizer = loaded
    ids = encode_prompt(tokenizer, "hi", chat_template=True, system_prompt="Be brief.")
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(151644) == 3 and ids.count(151645) == 2
    default = tokenizer.decode(encode_prompt(tokenizer, "hi", chat_template=True))
    assert default.startswith("<|im_start|>system\nYou are Qwen")


def test_weights_are_seeded_and_shared_across_depths():
    def q_proj(layers: int, seed: int) -> mx.array:
        model = init_model(model_config(RealShapeSpec(layers=layers, seed=seed)), seed)
        return model.model.layers[0].self_attn.q_proj.weight  # lazy: only this array is computed

    first = q_proj(1, 0)
    assert mx.array_equal(first, q_proj(2, 0)).item()
    assert not mx.array_equal(first, q_proj(1, 1)).item()
    assert abs(first.astype(mx.float32).std().item() - 0.02) < 1e-3


def test_cache_reuses_a_build_and_a_failed_build_leaves_nothing(realshape_cache_dir, realshape_model_dir, tmp_path,
                                                                 monkeypatch):
    assert build_realshape("realshape:qwen2.5-0.5b?layers=1", realshape_cache_dir) == realshape_model_dir

    def killed(*_args: Any, **_kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("mlx_lm.utils.save_model", killed)
    stale = tmp_path / ".qwen2.5-0.5b-l2-s0-bf16-v1.dead"  # what a SIGKILLed build leaves behind
    stale.mkdir()
    os.utime(stale, (0, 0))
    with pytest.raises(KeyboardInterrupt):
        build_realshape("realshape:qwen2.5-0.5b?layers=2", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_learner_resolves_a_realshape_path(realshape_cache_dir, realshape_model_dir, tmp_path):
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"),
        "model": {"path": "realshape:qwen2.5-0.5b?layers=1", "cache_dir": str(realshape_cache_dir)},
    })
    assert resolve_model_path(cfg, build_task(cfg.task)) == str(realshape_model_dir.resolve())


def test_4bit_model_is_mlx_lms_own_quantisation(realshape_q4_model_dir):
    model, _, config = mlx_lm.load(str(realshape_q4_model_dir), return_config=True)
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert isinstance(model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # the tied head is 4-bit too
    assert sum(f.stat().st_size for f in realshape_q4_model_dir.glob("*.safetensors")) < 110e6


@pytest.fixture(scope="module")
def cpu_learner(realshape_q4_model_dir: Path) -> Policy:
    """The 4-bit model as a CPU learner loads it: LoRA, dequantised, fp32."""
    return load_policy(str(realshape_q4_model_dir), lora=LORA)


def test_cpu_load_dequantises_4bit_with_same_logits(realshape_q4_model_dir, cpu_learner):
    digest = model_digest(str(realshape_q4_model_dir))
    policy = cpu_learner
    assert mx.default_device() == mx.cpu and not is_quantized(policy.model)
    assert type(policy.model.layers[0].self_attn.q_proj.linear) is nn.Linear
    reference, _ = mlx_lm.load(str(realshape_q4_model_dir))
    cast_floating(reference, "float32")  # the same 4-bit matmul, fp32 scales and activations
    tokens = mx.array([[151644, 872, 198, 15, 16, 17, 151645, 198]])
    assert mx.allclose(policy.model(tokens), reference(tokens), atol=1e-3, rtol=1e-3).item()
    assert model_digest(str(realshape_q4_model_dir)) == digest  # the digest is of the files on disk
    assert policy.model.model.embed_tokens.weight.dtype == mx.float32


def test_adapters_from_a_dequantised_learner_fit_a_4bit_actor(realshape_q4_model_dir, cpu_learner):
    learner = cpu_learner
    metal_like = load_policy(str(realshape_q4_model_dir), lora=LORA, dequantize=False)
    assert is_quantized(metal_like.model)
    blob = weights_to_bytes(trainable_weights(learner.model))
    load_weight_blob(metal_like.model, blob, digest_bytes(blob))
    with pytest.raises(ValueError, match="quantized"):
        load_policy(str(realshape_q4_model_dir))  # full fine-tuning of a 4-bit model stays refused everywhere


def test_doctor_says_cpu_dequantises_with_both_speeds():
    from grpo_fleet.runtime.doctor import quantized_description

    line = quantized_description()
    assert line.startswith("dequantised to float32 on load") and "4-bit matmul" in line and "fp32" in line


def test_build_model_cli_refuses_an_unknown_shape(capsys):
    from grpo_fleet.cli.main import main

    assert main(["build-model", "realshape:llama-7b?layers=1"]) == 2
    assert "unknown real shape" in capsys.readouterr().err


def test_actor_samples_and_learner_rescores_at_the_real_vocabulary(cpu_learner):
    from grpo_fleet.models.generation import SamplingSettings, generate_groups

    tokenizer, model = cpu_learner.tokenizer, cpu_learner.model
    prompt = encode_prompt(tokenizer, "Reverse 123.", chat_template=True)
    settings = SamplingSettings(group_size=2, max_tokens=6, stop_token_ids=tuple(tokenizer.eos_token_ids))
    for completion in generate_groups(model, [prompt], settings)[0]:
        assert all(0 <= t < VOCAB for t in completion.tokens)
        assert isinstance(tokenizer.decode(completion.tokens), str)
        sequence = mx.array([prompt + completion.tokens])
        logits = model(sequence[:, :-1])[0, len(prompt) - 1 :].astype(mx.float32)
        targets = sequence[0, len(prompt) :]
        rescored = mx.take_along_axis(logits - mx.logsumexp(logits, axis=-1, keepdims=True), targets[:, None], axis=-1)
        assert mx.allclose(rescored[:, 0], mx.array(completion.logprobs), atol=2e-3).item()


def test_cache_names_read_back_as_specs():
    for text in ("realshape:qwen2.5-0.5b", "realshape:qwen2.5-0.5b?layers=3&seed=7&bits=4&group_size=32"):
        spec = parse_spec(text)
        assert spec_from_key(spec.key()) == replace(spec, layers=spec.num_layers)
    for name in ("tiny-model", "qwen2.5-0.5b-l25-s0-bf16-v1", "qwen2.5-0.5b-l2-s0-bf16-v0", "llama-l2-s0-bf16-v1"):
        assert spec_from_key(name) is None
