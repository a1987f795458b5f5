"""NumPy's exp in the learner's gradient-free forwards (learner/step/vector_exp.py), against NumPy and MLX."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.learner.step import vector_exp

X = np.random.default_rng(0).normal(0.0, 4.0, (3, 5, 33)).astype(np.float32)
W = np.random.default_rng(1).normal(0.0, 1.0, (3, 5, 33)).astype(np.float32)


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return {"exp": np.exp(x), "sigmoid": 1 / (1 + np.exp(-x)), "swiglu": x / (1 + np.exp(-x)) * (0.5 * x),
            "logsumexp": np.log(np.exp(x - top).sum(-1)) + top[..., 0]}[name]


FUNCTIONS = {"exp": vector_exp.exp, "sigmoid": vector_exp.sigmoid, "logsumexp": vector_exp.logsumexp,
             "swiglu": lambda t: vector_exp.swiglu(t, 0.5 * t)}
MLX = {"exp": mx.exp, "sigmoid": mx.sigmoid, "logsumexp": lambda t: mx.logsumexp(t, axis=-1),
       "swiglu": lambda t: mx.sigmoid(t) * t * (0.5 * t)}


def _weighted(fn, w):
    return lambda t: (fn(t) * (w if fn(t).ndim == 3 else w[..., 0])).sum()


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_function_in_the_scope_is_numpys_value_and_mlxs_gradient(name):
    x, w = mx.array(X), mx.array(W)
    with vector_exp.numpy_scope():
        assert vector_exp.numpy_active()
        value = np.array(FUNCTIONS[name](x))
        grad = np.array(mx.grad(_weighted(FUNCTIONS[name], w))(x))
    want = _reference(name, X)
    np.testing.assert_allclose(value, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    theirs = np.array(mx.grad(_weighted(MLX[name], w))(x))
    np.testing.assert_allclose(grad, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_outside_the_scope_and_on_other_threads_mlx_computes_it():
    seen = []
    with vector_exp.numpy_scope():
        worker = threading.Thread(target=lambda: seen.append(vector_exp.numpy_active()))
        worker.start()
        worker.join()
        with vector_exp.numpy_scope():
            pass
        assert vector_exp.numpy_active()  # a nested scope leaves the outer one open
    assert seen == [False] and not vector_exp.numpy_active()
    vector_exp.use_numpy(False)
    try:
        with vector_exp.numpy_scope():
            assert not vector_exp.numpy_active()  # a Trainer that compiles turned it off
    finally:
        vector_exp.use_numpy(True)


def test_half_precision_and_masked_rows_come_back_as_they_went_in():
    x = mx.array([[0.5, -mx.inf, 2.0], [-mx.inf, -mx.inf, -mx.inf]], dtype=mx.bfloat16)
    with vector_exp.numpy_scope():
        out = vector_exp.logsumexp(x)
        weights = vector_exp.exp(x[:1])
    assert out.dtype == mx.bfloat16 and weights.dtype == mx.bfloat16
    assert np.isclose(float(out[0]), float(mx.logsumexp(x[:1].astype(mx.float32))), atol=1e-2)
    assert float(out[1]) == -np.inf and float(weights[0, 1]) == 0.0


def test_frozen_logprobs_through_numpy_equal_mlxs(tiny_model_dir):
    from test_trainer import varied_batch

    from grpo_fleet.config import LoraConfig
    from grpo_fleet.learner.step.attention import use_fast_functions
    from grpo_fleet.learner.step.batch import split_batch
    from grpo_fleet.learner.step.forward import frozen_logprobs
    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4))
    micro = split_batch(varied_batch(), 64)
    results = {}
    for numpy_exp in (False, True):
        use_fast_functions(policy.model, 4, numpy_exp=numpy_exp)  # 4 queries a chunk: the rows are chunked
        results[numpy_exp] = [np.array(v) for v in frozen_logprobs(policy.model, micro, temperature=0.7, chunk_tokens=5)]
    use_fast_functions(policy.model, None, numpy_exp=True)
    for ours, theirs in zip(results[True], results[False]):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5)
