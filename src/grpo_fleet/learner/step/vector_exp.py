"""The exponentials of the learner's gradient-free forwards through NumPy's vectorized exp, where MLX runs on the CPU.

MLX's CPU `exp` runs at about an eighth of NumPy's on the same core here (63-68 M
values/s against 546 M: its Linux wheel's exp looks scalar), and a forward takes the
exp of every attention score, every vocabulary logit at the completion positions and
every SiLU input. At 2 x 572 tokens of SmolLM2-135M that bounded the step at 0.40x of
the doctor's matmul (bench/RESULTS.md).

Each function here (exp, sigmoid, the last axis's log-sum-exp, swiglu) is the MLX
op, except inside `numpy_scope()` on the CPU backend: there it is an
`mx.custom_function` whose forward hands the values to NumPy and
whose gradient is written out in MLX ops from the output. Values are computed in
float32 and returned in the input's dtype.

Only the forwards that take no gradient open the scope (`forward.frozen_logprobs`:
pi_ref, pi_prox and the verification passes). Handing values to NumPy evaluates
them mid-graph, and inside a traced gradient an evaluated array keeps every
intermediate of the graph behind it until the backward runs: measured on SmolLM2's
step at 2 x 572 tokens, the peak went from 1.97 to 7.0 GiB (the LM head's
log-sum-exp) and 11.6 GiB (attention). Nor may it run under `mx.compile`, which
cannot trace an evaluation; a Trainer that compiles turns it off.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, cast

import mlx.core as mx
import numpy as np

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


def numpy_active() -> bool:
    return _enabled and getattr(_scope, "on", False) and mx.default_device().type == mx.DeviceType.cpu


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
    return cast(mx.array, _numpy_exp(x)) if numpy_active() else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    return cast(mx.array, _numpy_sigmoid(x)) if numpy_active() else mx.sigmoid(x)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis."""
    return cast(mx.array, _numpy_logsumexp(x)) if numpy_active() else mx.logsumexp(x, axis=-1)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (silu(gate) * x), its sigmoid through `sigmoid`."""
    return gate * sigmoid(gate) * x
