"""Run MLX's Linux CPU backend on a system OpenBLAS instead of the bundled reference BLAS.

MLX's Linux wheel ships the reference BLAS (about 5 GF/s for fp32 matmul here);
preloading Debian's OpenBLAS gives about 30x that. The switch has to happen before
the process loads libmlx, so the CLI re-executes itself with LD_PRELOAD set.

OpenBLAS picks its kernels by CPU model. Debian's 0.3.21 does not know recent
Xeons (this VM's, with AVX-512 FP16, reads as "Intel Xeon Processor") and falls
back to its Prescott kernels, SSE3 only: 29 GF/s against 170 with its SkylakeX
kernels on the same machine. So unless OPENBLAS_CORETYPE is set already, the
kernels are named from the CPU's own flags (`openblas_coretype`).
Nothing here applies on macOS, where MLX uses Accelerate/Metal.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Optional

OPENBLAS_CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
DISABLE_ENV = "GRPO_FLEET_NO_OPENBLAS"
CORETYPE_ENV = "OPENBLAS_CORETYPE"
_MARKER_ENV = "GRPO_FLEET_BLAS_REEXEC"
# OpenBLAS kernel families by the instructions they need, best first.
KERNELS = (
    ("SkylakeX", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "fma"})),
    ("Haswell", frozenset({"avx2", "fma"})),
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def openblas_coretype(flags: Optional[frozenset[str]] = None) -> Optional[str]:
    """The best OpenBLAS kernels this CPU can run, or None (leave OpenBLAS to its own detection)."""
    flags = cpu_flags() if flags is None else flags
    return next((name for name, needed in KERNELS if needed <= flags), None)


def find_openblas() -> Optional[str]:
    """Path of a system OpenBLAS shared library, or None."""
    arch = platform.machine()
    for pattern in OPENBLAS_CANDIDATES:
        path = Path(pattern.format(arch=arch))
        if path.exists():
            return str(path)
    return None


def preloaded_blas() -> Optional[str]:
    """The OpenBLAS named in LD_PRELOAD, if any."""
    for item in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "openblas" in item:
            return item
    return None


def child_env(env: Optional[dict] = None) -> dict:
    """An environment for a child process that will also run on OpenBLAS, unless that environment opts out."""
    env = dict(os.environ if env is None else env)
    if env.get(DISABLE_ENV):
        return env
    library = find_openblas()
    if not (sys.platform.startswith("linux") and library):
        return env
    if library not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [library, env.get("LD_PRELOAD", "")]))
    coretype = openblas_coretype()
    if coretype and not env.get(CORETYPE_ENV):
        env[CORETYPE_ENV] = coretype
    return env


def reexec_with_openblas() -> None:
    """Re-exec the current command with OpenBLAS preloaded (Linux only, once, opt-out by env)."""
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_ENV) or os.environ.get(_MARKER_ENV):
        return
    if "mlx.core" in sys.modules or find_openblas() is None:
        return
    if preloaded_blas() and (os.environ.get(CORETYPE_ENV) or openblas_coretype() is None):
        return
    env = child_env()
    env[_MARKER_ENV] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":
    # `python -m grpo_fleet.runtime.blas`: the variables a child gets, for the Makefile (`env $(...) command`).
    given = {key: os.environ[key] for key in (DISABLE_ENV, CORETYPE_ENV) if key in os.environ}
    added = child_env(given)
    print(" ".join(f"{key}={added[key]}" for key in ("LD_PRELOAD", CORETYPE_ENV) if key in added))
