"""Tiny-model factory, mlx_lm loading, LoRA reference, weight blobs and checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from grpo_fleet.config import LoraConfig, TinyModelConfig
from grpo_fleet.models.loading import (
    adapters_disabled,
    digest_bytes,
    load_checkpoint,
    load_policy,
    load_weight_blob,
    save_checkpoint,
    trainable_weights,
    weights_to_bytes,
)
from grpo_fleet.models.tiny_model import build_tiny_model
from helpers import assert_checkpoint_generates_like_the_learner

CORPUS = ["123=321", "45=54", "9=9", "<think> </think> <answer> </answer>"]


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for item in sorted(path.iterdir()):
        digest.update(item.name.encode() + item.read_bytes())
    return digest.hexdigest()


def test_tiny_model_is_deterministic_for_a_seed(tmp_path):
    first = build_tiny_model(tmp_path / "a", TinyModelConfig(seed=7), CORPUS)
    second = build_tiny_model(tmp_path / "b", TinyModelConfig(seed=7), CORPUS)
    third = build_tiny_model(tmp_path / "c", TinyModelConfig(seed=8), CORPUS)
    assert _tree_digest(first) == _tree_digest(second)
    assert _tree_digest(first) != _tree_digest(third)


def test_tiny_model_loads_through_mlx_lm_with_specials(tiny_model_dir):
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert len(tokenizer.eos_token_ids) >= 1
    assert tokenizer.chat_template
    assert tokenizer.decode(tokenizer.encode("507=", add_special_tokens=False)) == "507="
    # digits are single tokens, which the reversal task relies on
    assert len(tokenizer.encode("507", add_special_tokens=False)) == 3
    text = mlx_lm.generate(model, tokenizer, "12=", max_tokens=4)
    assert isinstance(text, str)


def test_cpu_backend_trains_in_float32(tiny_model_dir):
    policy = load_policy(str(tiny_model_dir))
    dtypes = {v.dtype for _, v in tree_flatten(policy.model.parameters())}
    if mx.default_device() == mx.cpu:
        assert dtypes == {mx.float32}


def test_lora_reference_is_base_model_without_copy(tiny_model_dir):
    base = load_policy(str(tiny_model_dir))
    lora = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4, scale=10.0))
    tokens = mx.array([[5, 6, 7, 8, 9]])
    for name, value in trainable_weights(lora.model).items():
        if name.endswith("lora_b"):
            lora.model.load_weights([(name, mx.ones_like(value) * 0.05)], strict=False)
    with adapters_disabled(lora.model):
        reference = lora.model(tokens)
    adapted = lora.model(tokens)
    assert mx.allclose(reference, base.model(tokens), atol=1e-5)
    assert not mx.allclose(adapted, reference, atol=1e-3)
    assert all("lora" in name for name in trainable_weights(lora.model))


def test_weight_blob_roundtrip_and_digest_check(tiny_model_dir):
    source = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4))
    target = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4))
    weights = {k: v + 0.5 for k, v in trainable_weights(source.model).items()}
    blob = weights_to_bytes(weights)
    with pytest.raises(ValueError, match="digest"):
        load_weight_blob(target.model, blob, "0" * 64)
    before = trainable_weights(target.model)
    assert all(mx.array_equal(before[k], trainable_weights(target.model)[k]) for k in before)
    load_weight_blob(target.model, blob, digest_bytes(blob))
    after = trainable_weights(target.model)
    assert all(mx.array_equal(after[k], weights[k]) for k in weights)


def test_weight_blob_with_unknown_name_is_refused(tiny_model_dir):
    target = load_policy(str(tiny_model_dir))
    blob = weights_to_bytes({"not.a.weight": mx.zeros((2,))})
    with pytest.raises(ValueError, match="does not fit"):
        load_weight_blob(target.model, blob, digest_bytes(blob))


@pytest.mark.parametrize("use_lora", [True, False])
def test_checkpoint_loads_with_mlx_lm_and_generates(tiny_model_dir, tmp_path, use_lora):
    lora = LoraConfig(enabled=True, rank=4) if use_lora else None
    policy = load_policy(str(tiny_model_dir), lora=lora)
    for name, value in trainable_weights(policy.model).items():
        policy.model.load_weights([(name, value + 0.01)], strict=False)
    out = save_checkpoint(policy, tmp_path / "ckpt", extra={"step": 3})
    if use_lora:
        assert (out / "adapters.safetensors").exists() and (out / "adapter_config.json").exists()
        model, tokenizer = mlx_lm.load(str(tiny_model_dir), adapter_path=str(out))
    else:
        assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
        model, tokenizer = mlx_lm.load(str(out))
    tokens = mx.array([[4, 5, 6]])
    assert mx.allclose(model(tokens).astype(mx.float32), policy.model(tokens), atol=1e-3)
    reloaded, _ = load_checkpoint(out)
    assert mx.allclose(reloaded(tokens).astype(mx.float32), policy.model(tokens), atol=1e-3)
    # The checkpoint's text through mlx_lm and through the actors' decode: the moved weights, not the base's.
    text = assert_checkpoint_generates_like_the_learner(out, "12=", max_tokens=3)
    assert text == mlx_lm.generate(model, tokenizer, "12=", max_tokens=3)


def test_the_generation_check_fails_when_mlx_lm_loads_other_weights(tiny_model_dir, tmp_path, monkeypatch):
    """Positive control for assert_checkpoint_generates_like_the_learner: mlx_lm handed the base model
    instead of the checkpoint's moved weights is caught, not waved through as a near-tie."""
    import grpo_fleet.models.loading

    policy = load_policy(str(tiny_model_dir))
    for index, (name, value) in enumerate(trainable_weights(policy.model).items()):
        moved = value + mx.random.normal(value.shape, key=mx.random.key(index)) * 0.5
        policy.model.load_weights([(name, moved)], strict=False)
    out = save_checkpoint(policy, tmp_path / "ckpt", extra={"step": 1})
    base_model, base_tokenizer = mlx_lm.load(str(tiny_model_dir))
    moved_model, _ = load_checkpoint(out)
    prompt = "123="
    assert mlx_lm.generate(base_model, base_tokenizer, prompt, max_tokens=4) != mlx_lm.generate(
        moved_model, base_tokenizer, prompt, max_tokens=4), "the control needs weights that change the text"
    monkeypatch.setattr(grpo_fleet.models.loading, "load_checkpoint", lambda _path: (base_model, base_tokenizer))
    with pytest.raises(AssertionError, match="not a near-tie|tokens"):
        assert_checkpoint_generates_like_the_learner(out, prompt, max_tokens=4)


def test_checkpoint_overwrite_is_atomic(tiny_model_dir, tmp_path):
    policy = load_policy(str(tiny_model_dir))
    target = tmp_path / "ckpt"
    save_checkpoint(policy, target, extra={"step": 1})
    save_checkpoint(policy, target, extra={"step": 2})
    assert '"step": 2' in (target / "grpo_fleet.json").read_text()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert leftovers == []
