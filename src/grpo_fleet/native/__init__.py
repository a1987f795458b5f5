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
from typing import Optional

BUILD_HINT = "build it with `make native` (cmake, a C++ compiler and the `native` extra's nanobind)"


def load_vector_exp() -> tuple[Optional[ModuleType], str]:
    """The built `_vector_exp` module and the kernel it runs ('avx2-fma' or 'scalar'), or None and why not."""
    try:
        module = importlib.import_module("grpo_fleet.native._vector_exp")
    except ImportError as err:
        return None, f"not built ({err}); {BUILD_HINT}"
    try:  # an mx.array crosses into the module only when both were built against one nanobind ABI
        import mlx.core as mx

        value = module.exp(mx.array([0.0, 1.0], dtype=mx.float32))
        mx.eval(value)
        ok = abs(value[0].item() - 1.0) < 1e-6 and abs(value[1].item() - 2.718281828) < 1e-5
    except (TypeError, RuntimeError, ValueError) as err:
        return None, f"built, but it does not run with this MLX ({err}); {BUILD_HINT}"
    if not ok:
        return None, "built, but its exp is wrong on this CPU"
    return module, str(module.kernel())
