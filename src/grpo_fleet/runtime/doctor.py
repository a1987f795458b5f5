"""`grpo-fleet doctor`: which MLX backend and BLAS this process runs on, and how fast."""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Callable, Optional

from grpo_fleet.runtime.blas import CORETYPE_ENV, find_openblas


def loaded_blas_libraries() -> list[str]:
    """Shared libraries with BLAS in their name mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as handle:
            paths = {line.split()[-1] for line in handle if "blas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def matmul_gflops(size: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul throughput of the default MLX device."""
    import mlx.core as mx

    a = mx.random.normal((size, size))
    b = mx.random.normal((size, size))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * size**3 / seconds / 1e9


def quantized_matmul_gflops(tokens: int = 64, width: int = 896, out: int = 4864) -> tuple[float, float]:
    """4-bit (group 64) and fp32 throughput of one MLP-sized projection, as (quantized, float) GF/s."""
    import mlx.core as mx

    x = mx.random.normal((tokens, width))
    w = mx.random.normal((out, width))
    packed, scales, biases = mx.quantize(w, group_size=64, bits=4)

    def rate(compute: Callable[[], object]) -> float:
        mx.eval(compute())
        start = time.perf_counter()
        mx.eval(compute())
        return 2 * tokens * width * out / (time.perf_counter() - start) / 1e9

    quantized = rate(lambda: mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4))
    return quantized, rate(lambda: x @ w.T)


def wants_dequantize(dequantize: Optional[bool]) -> bool:
    """An explicit choice, else: dequantise on the CPU backend only (models/quant.py says why)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu if dequantize is None else dequantize


def quantized_description() -> str:
    """What loading a quantized model does on this backend, and the speeds that decided it."""
    import mlx.core as mx

    quantized, dense = quantized_matmul_gflops()
    speeds = f"4-bit matmul {quantized:.1f} GF/s vs fp32 {dense:.1f} GF/s"
    if wants_dequantize(None):
        return f"dequantised to float32 on load ({speeds}; ~7x the 4-bit weight memory)"
    return f"kept quantized on {mx.default_device()} ({speeds})"


def mlx_version() -> str:
    """The MLX version this process runs (mx.__version__, which MLX's type stubs leave out)."""
    import mlx.core as mx

    return str(getattr(mx, "__version__", "unknown"))


def blas_description() -> str:
    """Which BLAS MLX's CPU matmul goes through in this process."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    libraries = loaded_blas_libraries()
    if any("openblas" in lib for lib in libraries):
        kernels = os.environ.get(CORETYPE_ENV)
        return ("OpenBLAS: " + ", ".join(lib for lib in libraries if "openblas" in lib)
                + (f" ({kernels} kernels, {CORETYPE_ENV})" if kernels else " (kernels by its own CPU detection)"))
    hint = "" if find_openblas() else " (install libopenblas0-pthread for ~30x faster fp32 matmul)"
    return "bundled reference BLAS" + hint


def exp_description() -> str:
    """Which exp the learner's step takes where MLX runs on the CPU: grpo-fleet's native kernel, or MLX's (and why)."""
    if sys.platform == "darwin":
        return "MLX's (the GPU's kernels)"
    from grpo_fleet.native import vector_exp_module

    module, detail = vector_exp_module()
    return f"native vector_exp ({detail})" if module is not None else f"MLX's, scalar on x86: native vector_exp {detail}"


def report() -> str:
    import mlx.core as mx

    lines = [
        f"python      {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"mlx         {mlx_version()}",
        f"device      {mx.default_device()}",
        f"blas        {blas_description()}",
        f"matmul      {matmul_gflops():.1f} GF/s (fp32, 1024x1024)",
        f"quantized   {quantized_description()}",
        f"exp         {exp_description()}",
    ]
    return "\n".join(lines)
