"""Tests for grpo_fleet.learner.step.logprobs against the float64 NumPy reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from grpo_reference import ref_token_logprobs

from grpo_fleet.learner.step.logprobs import chunked_logprobs, token_logprobs

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


@pytest.mark.parametrize("seed", range(3))
def test_token_logprobs_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b, t, v = (int(x) for x in rng.integers(1, 9, size=3))
    v += 1
    logits = (rng.normal(size=(b, t, v)) * 3).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    got = token_logprobs(mx.array(logits), mx.array(targets))
    assert got.shape == (b, t) and got.dtype == mx.float32
    np.testing.assert_allclose(_np(got), ref_token_logprobs(logits, targets), atol=ATOL, rtol=RTOL)


def test_token_logprobs_is_stable_for_large_logits(rng: np.random.Generator) -> None:
    # exp(300) overflows float32; a naive softmax would give inf/NaN.
    logits = (rng.normal(size=(2, 3, 11)) * 100.0).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 3))
    got = _np(token_logprobs(mx.array(logits), mx.array(targets)))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref_token_logprobs(logits, targets), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_token_logprobs_upcasts_half_precision(dtype: mx.Dtype, rng: np.random.Generator) -> None:
    logits = rng.normal(size=(2, 5, 300)).astype(np.float32)
    targets = rng.integers(0, 300, size=(2, 5))
    half = mx.array(logits).astype(dtype)
    got = token_logprobs(half, mx.array(targets))
    assert got.dtype == mx.float32
    want = ref_token_logprobs(np.array(half.astype(mx.float32)), targets)
    np.testing.assert_allclose(_np(got), want, atol=1e-4)


def test_token_logprobs_rejects_misaligned_shapes() -> None:
    with pytest.raises(ValueError):
        token_logprobs(mx.zeros((2, 4, 5)), mx.zeros((2, 3), dtype=mx.int32))


def test_chunked_logprobs_match_the_reference_for_any_chunk() -> None:
    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(11, 6)).astype(np.float32)
    weight = rng.normal(size=(13, 6)).astype(np.float32)
    targets = rng.integers(0, 13, 11).astype(np.int32)
    want = ref_token_logprobs((hidden @ weight.T / 0.6)[None], targets[None])[0]
    for chunk in (1, 4, 11, 50):
        got = chunked_logprobs(mx.array(hidden), mx.array(targets), lambda p, h: h @ p["w"].T, {"w": mx.array(weight)},
                               temperature=0.6, chunk_size=chunk)
        np.testing.assert_allclose(_np(got), want, atol=ATOL, rtol=RTOL)


def test_chunked_logprob_gradient_holds_about_one_chunk_of_logits_under_a_memory_limit() -> None:
    """The chunks are chained, so once MLX throttles at its memory limit they run one at a time."""
    vocab, dim, k, chunk = 8192, 32, 512, 32
    weight = mx.random.normal((vocab, dim)) * 0.1
    hidden, targets = mx.random.normal((k, dim)), mx.random.randint(0, vocab, (k,))
    mx.eval(weight, hidden, targets)
    one_chunk = chunk * vocab * 4  # bytes of one chunk's fp32 logits; all K positions would be 16x that
    grad = mx.grad(lambda h: mx.sum(chunked_logprobs(h, targets, lambda p, x: x @ p["w"].T, {"w": weight},
                                                     temperature=0.8, chunk_size=chunk)))
    mx.eval(grad(hidden))
    mx.clear_cache()
    base = mx.get_active_memory()
    previous = mx.set_memory_limit(base + 2 * one_chunk)
    try:
        mx.reset_peak_memory()
        mx.eval(grad(hidden))
        above = mx.get_peak_memory() - base
    finally:
        mx.set_memory_limit(previous)
    assert above < 4 * one_chunk, above / one_chunk  # unthrottled, about 7 chunks are live at once
