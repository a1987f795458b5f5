"""Native kernels, built from this folder's C++ by `make native` (the Makefile's install step on Linux).

`vector_exp.cpp` is exp as an MLX primitive whose CPU kernel is vectorized (AVX2
and FMA where the CPU has them): MLX's own CPU exp is scalar on x86 and bounds a
long row's step. The module is optional: where it was not built (macOS, whose
GPU needs none of this; an install without a compiler; an MLX whose nanobind ABI
moved on), `load_vector_exp` says why and callers keep MLX's exp.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional, cast

import mlx.core as mx

BUILD_HINT = "build it with `make native` (cmake, a C++ compiler and the `native` extra's nanobind)"


def load_vector_exp() -> tuple[Optional[ModuleType], str]:
    """The built `_vector_exp` module and the kernel it runs ('avx2-fma' or 'scalar'), or None and why not."""
    try:
        module = importlib.import_module("grpo_fleet.native._vector_exp")
    except ImportError as err:
        return None, f"not built ({err}); {BUILD_HINT}"
    try:  # an mx.array crosses into the module only when both were built against one nanobind ABI
        value = module.exp(mx.array([0.0, 1.0], dtype=mx.float32))
        mx.eval(value)
        ok = abs(value[0].item() - 1.0) < 1e-6 and abs(value[1].item() - 2.718281828) < 1e-5
    except (TypeError, RuntimeError, ValueError) as err:
        return None, f"built, but it does not run with this MLX ({err}); {BUILD_HINT}"
    if not ok:
        return None, "built, but its exp is wrong on this CPU"
    return module, str(module.kernel())


_loaded: Optional[tuple[Optional[ModuleType], str]] = None
_switched_on = True


def vector_exp_module() -> tuple[Optional[ModuleType], str]:
    """`load_vector_exp()`, once per process."""
    global _loaded
    if _loaded is None:
        _loaded = load_vector_exp()
    return _loaded


def use(enabled: bool) -> bool:
    """Process-wide: the native kernel where MLX runs on the CPU (the default). Returns whether it is built."""
    global _switched_on
    _switched_on = enabled
    return vector_exp_module()[0] is not None


def active() -> bool:
    """Whether `exp` below may run: built, switched on, and MLX's default device is the CPU."""
    return _switched_on and vector_exp_module()[0] is not None and mx.default_device().type == mx.DeviceType.cpu


# The functions below need the module (callers check `active()` first). They compute in float32 and return the
# input's dtype; their gradients are MLX ops on their outputs, so they serve in traced gradients and mx.compile.

def exp(x: mx.array) -> mx.array:
    module = vector_exp_module()[0]
    assert module is not None, "grpo_fleet.native.exp without the built kernel: check active() first"
    if x.dtype == mx.float32:
        return module.exp(x)
    return module.exp(x.astype(mx.float32)).astype(x.dtype)


@mx.custom_function
def _sigmoid(x: mx.array) -> mx.array:
    return (1.0 / (1.0 + exp(-x.astype(mx.float32)))).astype(x.dtype)


@_sigmoid.vjp
def _sigmoid_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    return (cotangent * output * (1.0 - output),)


@mx.custom_function
def _logsumexp(x: mx.array) -> mx.array:
    values = x.astype(mx.float32)
    top = mx.max(values, axis=-1, keepdims=True)  # shifted by the row's max: no overflow
    top = mx.where(mx.isfinite(top), top, 0.0)  # and a row of -inf stays finite until the log
    return (mx.log(mx.sum(exp(values - top), axis=-1)) + top[..., 0]).astype(x.dtype)


@_logsumexp.vjp
def _logsumexp_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    x = primals[0] if isinstance(primals, (list, tuple)) else primals  # MLX passes a lone input bare
    return (cotangent[..., None] * exp(x - output[..., None]),)


def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + exp(-x)); its VJP is cotangent * s * (1 - s)."""
    return cast(mx.array, _sigmoid(x))


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis; its VJP is cotangent * exp(x - lse)."""
    return cast(mx.array, _logsumexp(x))
