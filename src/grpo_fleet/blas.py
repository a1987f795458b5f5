"""Run MLX's Linux CPU backend on a system OpenBLAS instead of the bundled reference BLAS.

MLX's Linux wheel ships the reference BLAS (about 5 GF/s for fp32 matmul here);
preloading Debian's OpenBLAS gives about 30x that. The switch has to happen before
the process loads libmlx, so the CLI re-executes itself with LD_PRELOAD set.
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
_MARKER_ENV = "GRPO_FLEET_BLAS_REEXEC"


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
    if sys.platform.startswith("linux") and library and library not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [library, env.get("LD_PRELOAD", "")]))
    return env


def reexec_with_openblas() -> None:
    """Re-exec the current command with OpenBLAS preloaded (Linux only, once, opt-out by env)."""
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_ENV) or os.environ.get(_MARKER_ENV):
        return
    if preloaded_blas() or "mlx.core" in sys.modules or find_openblas() is None:
        return
    env = child_env()
    env[_MARKER_ENV] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
