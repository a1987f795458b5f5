"""mlx-lm's decoding through the native exp (models/native_functions.py): attention against a cache, SiLU and the
inverse-CDF sampler, each against mlx-lm's own on the same values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet import native
from grpo_fleet.models.generation import token_sampler
from grpo_fleet.models.native_functions import (
    decode_attention,
    decode_attention_function,
    inverse_cdf_sampler,
    use_native_decoding,
)

RNG = np.random.default_rng(3)
Q = mx.array(RNG.normal(size=(3, 4, 1, 8)).astype(np.float32))  # 4 query heads sharing 2 key/value heads
K = mx.array(RNG.normal(size=(3, 2, 11, 8)).astype(np.float32))
V = mx.array(RNG.normal(size=(3, 2, 11, 8)).astype(np.float32))
LEFT_PADDED = mx.array(np.arange(11)[None, None, None, :] >= np.array([0, 3, 7])[:, None, None, None])


def _mlx_lm(mask):
    return mx.fast.scaled_dot_product_attention(Q, K, V, scale=0.35, mask=mask)


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive", "per head"])
def test_decode_attention_is_mlx_lms_on_a_cache(mask):
    given = {"none": None, "causal": "causal", "bool": LEFT_PADDED,
             "additive": mx.where(LEFT_PADDED, 0.0, -mx.inf), "per head": mx.broadcast_to(LEFT_PADDED, (3, 4, 1, 11))}[mask]
    theirs = _mlx_lm(None if mask in ("none", "causal") else given)
    ours = decode_attention(Q, K, V, 0.35, given)
    assert ours.shape == theirs.shape == (3, 4, 1, 8) and ours.dtype == mx.float32
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-6)
    if mask == "bool":  # the padding really was masked out: the unmasked answer differs
        assert not np.allclose(np.array(ours), np.array(_mlx_lm(None)), atol=1e-3)


def test_only_one_float32_query_row_without_sinks_takes_the_native_path():
    calls: list[str] = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append("original")
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    class QuantizedCache:
        bits = 8

    attention = decode_attention_function(original)
    attention(Q, K, V, None, 0.35, None)
    assert calls == []
    attention(mx.concatenate([Q, Q], axis=2), K, V, None, 0.35, None)  # prefill: two query rows
    attention(Q.astype(mx.bfloat16), K.astype(mx.bfloat16), V.astype(mx.bfloat16), None, 0.35, None)
    attention(Q, K, V, QuantizedCache(), 0.35, None)
    attention(Q, K, V, None, 0.35, None, sinks=mx.zeros((4,)))
    native.use(False)
    try:
        attention(Q, K, V, None, 0.35, None)
    finally:
        native.use(True)
    assert calls == ["original"] * 5


def test_the_inverse_cdf_sampler_draws_the_distribution():
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], dtype=np.float32)
    with np.errstate(divide="ignore"):
        logprobs = mx.broadcast_to(mx.array(np.log(probs)), (40_000, 6))
    mx.random.seed(0)
    drawn = inverse_cdf_sampler(logprobs)
    assert drawn.shape == (40_000,) and drawn.dtype == mx.uint32
    counts = np.bincount(np.array(drawn), minlength=6)
    assert counts[5] == 0  # probability 0 is never drawn
    expected = probs * 40_000
    assert np.all(np.abs(counts[:5] - expected[:5]) < 5 * np.sqrt(expected[:5]))  # 5 sigma


def test_the_actors_sampler_is_the_native_one_where_the_kernel_runs():
    assert token_sampler(1.0) is inverse_cdf_sampler
    assert token_sampler(0.0) is not inverse_cdf_sampler  # greedy stays argmax
    native.use(False)
    try:
        assert token_sampler(1.0) is not inverse_cdf_sampler  # mlx-lm's Gumbel-max
    finally:
        native.use(True)


def test_native_decoding_keeps_actor_and_learner_logprobs_together(tiny_model_dir):
    from test_rollout import _max_logprob_gap, _settings

    from grpo_fleet.models.generation import generate_groups
    from grpo_fleet.models.loading import load_policy
    from grpo_fleet.models.native_functions import ORIGINAL_ATTR, attention_module
    from grpo_fleet.tasks.prompts import encode_prompt

    policy = load_policy(str(tiny_model_dir))
    module = attention_module(policy.model)
    # mlx-lm's own functions (an earlier Trainer in this worker may have rebound them: what it wrapped)
    own = tuple(getattr(f, ORIGINAL_ATTR, f) for f in (module.scaled_dot_product_attention, module.swiglu))
    use_native_decoding(policy.model)
    try:
        assert (module.scaled_dot_product_attention, module.swiglu) != own
        mx.random.seed(5)
        prompts = [encode_prompt(policy.tokenizer, text, chat_template=False) for text in ("123=", "9=", "4567=")]
        groups = generate_groups(policy.model, prompts, _settings(policy, 0.8, group_size=8, max_tokens=8))
        assert _max_logprob_gap(policy, prompts, groups, 0.8) < 1e-4
    finally:
        use_native_decoding(policy.model, False)
    assert (module.scaled_dot_product_attention, module.swiglu) == own
