"""The learner's chunked causal attention against a NumPy reference: outputs and all three gradients."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet import native
from grpo_fleet.learner.step.attention import causal_attention, chunked_attention_function, use_chunked_attention


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, d_out: np.ndarray, scale: float):
    """Causal attention with grouped key/value heads, and its gradients, in float64."""
    heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
    k_full, v_full = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
    scores = np.einsum("bhqd,bhkd->bhqk", q, k_full) * scale
    scores = np.where(np.triu(np.ones((length, length), dtype=bool), 1), -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = probs @ v_full
    d_v = np.einsum("bhqk,bhqd->bhkd", probs, d_out)
    d_probs = d_out @ v_full.swapaxes(-1, -2)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True)) * scale
    d_q = d_scores @ k_full
    d_k = np.einsum("bhqk,bhqd->bhkd", d_scores, q)

    def per_kv_head(grad: np.ndarray) -> np.ndarray:  # the query heads sharing a key/value head add up
        return grad.reshape(grad.shape[0], kv_heads, heads // kv_heads, *grad.shape[2:]).sum(2)

    return out, d_q, per_kv_head(d_k), per_kv_head(d_v)


@pytest.mark.parametrize("length, chunk", [(37, 8), (37, 1), (37, 37), (37, 64), (96, 32)])
def test_outputs_and_gradients_equal_the_reference(length, chunk):
    rng = np.random.default_rng(length + chunk)
    q = rng.standard_normal((2, 6, length, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, length, 8)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    scale = 1 / math.sqrt(8)
    expected = _reference(*(a.astype(np.float64) for a in (q, k, v, d_out)), scale)

    def objective(q, k, v):
        return (causal_attention(q, k, v, scale, chunk) * mx.array(d_out)).sum()

    out = causal_attention(mx.array(q), mx.array(k), mx.array(v), scale, chunk)
    grads = mx.grad(objective, argnums=(0, 1, 2))(mx.array(q), mx.array(k), mx.array(v))
    for got, want in zip([out, *grads], expected):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)


def test_a_query_never_sees_a_later_key():
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 2, 20, 4)).astype(np.float32)) for _ in range(3))
    changed_v = mx.concatenate([v[:, :, :10], v[:, :, 10:] + 100.0], axis=2)
    before, after = (causal_attention(q, k, values, 0.5, 6) for values in (v, changed_v))
    np.testing.assert_array_equal(np.array(before[:, :, :10]), np.array(after[:, :, :10]))
    assert not np.allclose(np.array(before[:, :, 10:]), np.array(after[:, :, 10:]))


def test_heads_that_do_not_share_evenly_are_refused():
    q, k = mx.zeros((1, 5, 4, 2)), mx.zeros((1, 2, 4, 2))
    with pytest.raises(ValueError, match="5 query heads"):
        causal_attention(q, k, k, 1.0, 2)


def test_only_full_causal_rows_longer_than_a_chunk_leave_mlx_lms_function():
    calls: list[str] = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append("original")
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    attention = chunked_attention_function(original, chunk=4)
    q, kv = mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4))
    attention(q, kv, kv, None, 1.0, "causal")
    assert calls == [], "a full causal row past the chunk takes the chunked path"
    attention(q[:, :, :4], kv[:, :, :4], kv[:, :, :4], None, 1.0, "causal")  # no longer than a chunk
    attention(q, kv, kv, object(), 1.0, "causal")  # a cache
    attention(q, kv, kv, None, 1.0, mx.zeros((8, 8)))  # a mask of values (sliding windows)
    assert calls == ["original"] * 3
    attention(q[:, :, -1:], kv, kv, None, 1.0, None)  # decoding one token against a cache: the native kernel's
    native.use(False)
    try:
        attention(q[:, :, -1:], kv, kv, None, 1.0, None)  # and mlx-lm's where the kernel is off
    finally:
        native.use(True)
    assert calls == ["original"] * 4


def test_a_model_routes_its_attention_and_zero_restores_mlx_lms(tiny_model_dir):
    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(tiny_model_dir))
    model = policy.model
    tokens = mx.array((np.arange(40, dtype=np.int32) % policy.vocab_size)[None])
    own = model(tokens)
    assert use_chunked_attention(model, 8)
    chunked = model(tokens)
    assert use_chunked_attention(model, 0)
    restored = model(tokens)
    np.testing.assert_allclose(np.array(chunked), np.array(own), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.array(restored), np.array(own))
