"""The exponentials of the learner's forwards and backwards, vectorized where MLX runs on the CPU.

MLX's CPU `exp` is scalar on x86 (its polynomial calls `std::fma` per term):
63-68 M values/s against NumPy's 546 M on the same core, and a long row's step
takes the exp of every attention score, every vocabulary logit at the completion
positions and every SiLU input. At 2 x 572 tokens of SmolLM2-135M that bounded
the step at 0.40x of the doctor's matmul (bench/RESULTS.md).

Each function here (exp, sigmoid, the last axis's log-sum-exp, swiglu) takes, in
order of preference:

- **the native kernel** (`grpo_fleet/native/vector_exp.cpp`, built by `make
  native`): exp as an MLX primitive with an AVX2 loop, about 25x MLX's exp. It is
  lazy like any MLX op, so it serves inside traced gradients and `mx.compile`
  too, wherever MLX runs on the CPU;
- **NumPy**, only inside `numpy_scope()` (the forwards that take no gradient:
  `forward.frozen_logprobs`), where the native kernel is not built or is turned
  off. Handing values to NumPy evaluates them mid-graph, and inside a traced
  gradient an evaluated array keeps every intermediate behind it until the
  backward runs (measured: a peak of 11.4 GiB against 2.56), so NumPy never
  runs under a gradient or `mx.compile`;
- MLX's own op, everywhere else (and always on a GPU).

Values are computed in float32 and returned in the input's dtype. The gradients
are written out in MLX ops from the outputs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, cast

import mlx.core as mx
import numpy as np

from grpo_fleet import native

NATIVE_KERNEL = native.vector_exp_module()[1]  # the kernel's name, or why it is absent
_enabled = True
_scope = threading.local()  # the verifier's thread may run a forward while the training thread traces a gradient


def use_numpy(enabled: bool) -> None:
    """Process-wide: NumPy's exp in `numpy_scope` on the CPU backend (the default), or MLX's everywhere."""
    global _enabled
    _enabled = enabled


@contextmanager
def numpy_scope() -> Iterator[None]:
    """On this thread, for a forward that traces no gradient: NumPy's exp, where MLX runs on the CPU."""
    before = getattr(_scope, "on", False)
    _scope.on = True
    try:
        yield
    finally:
        _scope.on = before


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def use_native(enabled: bool) -> bool:
    """Process-wide: the native kernel where MLX runs on the CPU (the default). Returns whether it is built."""
    return native.use(enabled)


def native_active() -> bool:
    return native.active()


def numpy_active() -> bool:
    return _enabled and getattr(_scope, "on", False) and _on_cpu() and not native_active()


def fast_active() -> bool:
    """Whether `exp` here is faster than MLX's: the native kernel, or NumPy in its scope."""
    return native_active() or numpy_active()


def _float32(x: mx.array) -> np.ndarray:
    return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))


def _as(values: np.ndarray, like: mx.array) -> mx.array:
    out = mx.array(values)
    return out if out.dtype == like.dtype else out.astype(like.dtype)


@mx.custom_function
def _numpy_exp(x: mx.array) -> mx.array:
    return _as(np.exp(_float32(x)), x)


@_numpy_exp.vjp
def _numpy_exp_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    return (cotangent * output,)


@mx.custom_function
def _numpy_sigmoid(x: mx.array) -> mx.array:
    return _as(1.0 / (1.0 + np.exp(-_float32(x))), x)


@_numpy_sigmoid.vjp
def _numpy_sigmoid_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    return (cotangent * output * (1.0 - output),)


@mx.custom_function
def _numpy_logsumexp(x: mx.array) -> mx.array:
    values = _float32(x)
    top = values.max(axis=-1, keepdims=True)  # shifted by the row's max: no overflow
    top = np.where(np.isfinite(top), top, 0.0).astype(values.dtype)  # and a row of -inf stays finite until the log
    weights = np.exp(values - top)
    with np.errstate(divide="ignore"):  # a row of -inf only: its log-sum-exp is -inf, as MLX's is
        return _as((np.log(weights.sum(axis=-1, keepdims=True)) + top)[..., 0], x)


@_numpy_logsumexp.vjp
def _numpy_logsumexp_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    x = primals[0] if isinstance(primals, (list, tuple)) else primals  # MLX passes a lone input bare
    return (cotangent[..., None] * exp(x - output[..., None]),)


def exp(x: mx.array) -> mx.array:
    if native_active():
        return native.exp(x)
    return cast(mx.array, _numpy_exp(x)) if numpy_active() else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    if native_active():
        return native.sigmoid(x)
    return cast(mx.array, _numpy_sigmoid(x)) if numpy_active() else mx.sigmoid(x)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis."""
    if native_active():
        return native.logsumexp(x)
    return cast(mx.array, _numpy_logsumexp(x)) if numpy_active() else mx.logsumexp(x, axis=-1)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (silu(gate) * x), its sigmoid through `sigmoid`."""
    return gate * sigmoid(gate) * x
