"""The learner's vectorized exponentials (learner/step/vector_exp.py): the native kernel (grpo_fleet/native) and
NumPy's exp in the gradient-free forwards, each against NumPy in float64 and MLX's own gradients."""

from __future__ import annotations

import platform
import sys
import threading
from typing import Iterator

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.learner.step import vector_exp
from grpo_fleet.native import load_vector_exp

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


@pytest.fixture
def numpy_only() -> Iterator[None]:
    """The native kernel turned off, as where it was not built: NumPy's exp in the scope. (A Trainer built by an
    earlier test in this worker may have turned either off: the process-wide switches are set, then reset.)"""
    vector_exp.use_native(False)
    vector_exp.use_numpy(True)
    try:
        yield
    finally:
        vector_exp.use_native(True)


@pytest.fixture(params=["native", "numpy"])
def fast_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each vectorized path in turn: the native kernel everywhere, or NumPy's exp in `numpy_scope`."""
    vector_exp.use_native(request.param == "native")
    vector_exp.use_numpy(True)
    try:
        with vector_exp.numpy_scope():
            if request.param == "native":
                assert vector_exp.native_active() and not vector_exp.numpy_active()
            else:
                assert vector_exp.numpy_active() and not vector_exp.native_active()
            yield request.param
    finally:
        vector_exp.use_native(True)


def test_make_native_built_the_kernel_that_this_cpu_runs():
    if sys.platform == "darwin":
        pytest.skip("macOS: the GPU takes the exponentials; `make native` builds nothing there")
    module, kernel = load_vector_exp()
    assert module is not None, kernel  # `make test` builds it first (`make native`)
    if platform.machine() in ("x86_64", "AMD64"):
        flags = open("/proc/cpuinfo").read().split()
        assert kernel == ("avx2-fma" if "avx2" in flags and "fma" in flags else "scalar")
    assert vector_exp.NATIVE_KERNEL == kernel and vector_exp.native_active()


def test_a_kernel_that_is_absent_says_how_to_build_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "grpo_fleet.native._vector_exp", None)  # what importing a missing module raises
    module, why = load_vector_exp()
    assert module is None and "not built" in why and "make native" in why


def test_native_exp_over_the_whole_float32_range():
    ends = [np.inf, -np.inf, np.nan, 88.72283, 88.7229, 89.0, -87.3365, -87.34, -104.0, 0.0, -0.0, 1e-30]
    values = np.concatenate([np.linspace(-110, 110, 200_003), X.ravel(), ends]).astype(np.float32)
    ours = np.array(vector_exp.exp(mx.array(values)))
    want = np.exp(values.astype(np.float64))
    normal = (want >= np.finfo(np.float32).tiny) & (want <= np.finfo(np.float32).max)
    assert normal.sum() > 150_000
    rel = np.abs(ours[normal] - want[normal]) / want[normal]
    assert rel.max() < 3e-7  # Cephes' polynomial: within about two float32 ulps
    assert np.all(ours[(values > 88.7229) & np.isfinite(values)] == np.inf) and ours[-12] == np.inf
    assert np.all(ours[values < -87.34] == 0.0) and ours[-11] == 0.0  # flushed below FLT_MIN, as MLX's exp is
    assert np.isnan(ours[-10]) and np.sum(np.isnan(ours)) == 1


@pytest.mark.parametrize("layout", ["transposed", "broadcast", "strided", "empty", "scalar", "odd tail"])
def test_native_exp_takes_any_layout(layout):
    base = mx.array(X[0])
    x = {"transposed": base.T, "broadcast": mx.broadcast_to(base[:1], (7, 33)), "strided": base[::2, ::3],
         "empty": base[:0], "scalar": mx.array(1.5), "odd tail": mx.array(X.ravel()[:13])}[layout]
    out = vector_exp.exp(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(np.array(out), np.exp(np.array(x).astype(np.float64)), rtol=3e-7)


def test_native_exp_under_compile_vmap_and_jvp_is_mlxs():
    x = mx.array(X[0])
    np.testing.assert_allclose(np.array(mx.compile(lambda t: vector_exp.exp(t * 0.5) + 1.0)(x)),
                               np.array(mx.exp(x * 0.5) + 1.0), rtol=1e-6)  # MLX's exp errs by ulps too
    np.testing.assert_allclose(np.array(mx.vmap(vector_exp.exp, in_axes=1)(x)), np.array(mx.exp(x)).T, rtol=1e-6)
    _, (tangent,) = mx.jvp(vector_exp.exp, [x], [mx.ones_like(x) * 2.0])
    np.testing.assert_allclose(np.array(tangent), 2.0 * np.array(mx.exp(x)), rtol=1e-6)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_vectorized_function_is_the_value_and_mlxs_gradient(name, fast_path):
    x, w = mx.array(X), mx.array(W)
    value = np.array(FUNCTIONS[name](x))
    grad = np.array(mx.grad(_weighted(FUNCTIONS[name], w))(x))
    want = _reference(name, X)
    np.testing.assert_allclose(value, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    theirs = np.array(mx.grad(_weighted(MLX[name], w))(x))
    np.testing.assert_allclose(grad, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_outside_the_scope_and_on_other_threads_mlx_computes_it(numpy_only):
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


def test_half_precision_and_masked_rows_come_back_as_they_went_in(fast_path):
    x = mx.array([[0.5, -mx.inf, 2.0], [-mx.inf, -mx.inf, -mx.inf]], dtype=mx.bfloat16)
    out = vector_exp.logsumexp(x)
    weights = vector_exp.exp(x[:1])
    assert out.dtype == mx.bfloat16 and weights.dtype == mx.bfloat16
    assert np.isclose(float(out[0]), float(mx.logsumexp(x[:1].astype(mx.float32))), atol=1e-2)
    assert float(out[1]) == -np.inf and float(weights[0, 1]) == 0.0


def test_frozen_logprobs_through_the_native_kernel_and_numpy_equal_mlxs(tiny_model_dir):
    from test_trainer import varied_batch

    from grpo_fleet.config import LoraConfig
    from grpo_fleet.learner.step.attention import use_fast_functions
    from grpo_fleet.learner.step.batch import split_batch
    from grpo_fleet.learner.step.forward import frozen_logprobs
    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4))
    micro = split_batch(varied_batch(), 64)
    results = {}
    for native_exp, numpy_exp in ((False, False), (True, False), (False, True)):
        use_fast_functions(policy.model, 4, native_exp=native_exp, numpy_exp=numpy_exp)  # 4 queries a chunk
        results[native_exp, numpy_exp] = [np.array(v) for v in
                                          frozen_logprobs(policy.model, micro, temperature=0.7, chunk_tokens=5)]
    use_fast_functions(policy.model, None, native_exp=True, numpy_exp=True)
    for fast in ((True, False), (False, True)):
        for ours, theirs in zip(results[fast], results[False, False]):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5)
            assert not np.array_equal(ours, theirs) or fast == (False, True)  # another exp really ran
