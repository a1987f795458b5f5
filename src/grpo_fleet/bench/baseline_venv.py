"""A cached venv for a baseline trainer that must not share grpo-fleet's packages (mlx-lm-lora).

The venv lives under ~/.cache/grpo-fleet/bench-venvs (XDG_CACHE_HOME honoured,
GRPO_FLEET_BENCH_VENVS overrides), named after its requirements' digest: a
changed pin makes a new one, an unchanged one is reused. It is made with this
interpreter, so both sides run the same Python. A failed install removes the
half-made venv and raises BaselineUnavailable with pip's last words, so a bench
can skip the row and say why (typically: no package index reachable).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

MLX_LM_LORA_VERSION = "5.10.2"  # the version this bench was written against and tested with
READY = ".installed"


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run here; the message says why."""


def mlx_lm_lora_requirements(platform: str = sys.platform) -> list[str]:
    """mlx-lm-lora pinned, on the same mlx / mlx-lm as grpo-fleet's, plus what grpo_fleet.tasks needs (blake3)."""
    mlx = "mlx[cpu]" if platform.startswith("linux") else "mlx"
    return [f"mlx-lm-lora=={MLX_LM_LORA_VERSION}", _same_as_ours(mlx, "mlx"), _same_as_ours("mlx-lm", "mlx-lm"),
            _same_as_ours("blake3", "blake3"), _same_as_ours("math-verify", "math-verify")]


def _same_as_ours(requirement: str, distribution: str) -> str:
    try:
        return f"{requirement}=={version(distribution)}"
    except PackageNotFoundError:
        return requirement


def venv_root() -> Path:
    if os.environ.get("GRPO_FLEET_BENCH_VENVS"):
        return Path(os.environ["GRPO_FLEET_BENCH_VENVS"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "grpo-fleet" / "bench-venvs"


def venv_path(name: str, requirements: list[str], root: Optional[Path] = None) -> Path:
    """Where the venv for exactly these requirements lives."""
    digest = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:10]
    return (root or venv_root()) / f"{name}-{digest}"


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def ensure_venv(name: str = "mlx-lm-lora", requirements: Optional[list[str]] = None,
                root: Optional[Path] = None) -> Path:
    """The python of a venv with `requirements` installed, made (minutes) only the first time."""
    requirements = mlx_lm_lora_requirements() if requirements is None else requirements
    path = venv_path(name, requirements, root)
    if (path / READY).is_file():
        return venv_python(path)
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run([sys.executable, "-m", "venv", str(path)])
        _run([str(venv_python(path)), "-m", "pip", "install", "--quiet", *requirements])
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        shutil.rmtree(path, ignore_errors=True)
        detail = getattr(exc, "output", None) or str(exc)
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        raise BaselineUnavailable(f"could not install {' '.join(requirements)}: {detail.strip()[-600:]}") from exc
    (path / READY).write_text("\n".join(requirements) + "\n", encoding="utf-8")
    return venv_python(path)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800)
