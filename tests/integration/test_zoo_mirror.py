"""The zoo against a package mirror of its own, served over HTTP by a real process (PIP_INDEX_URL): a mirror that
serves a wheel larger than its pin is cut off at the pin and leaves nothing in the cache; an honest one's wheel is
downloaded, checked and its GGUF taken out."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from grpo_fleet.models.zoo import WheelPart, ZooError, ZooModel, fetch, sha256_digest
from helpers import free_port, wait_for

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@contextlib.contextmanager
def _mirror(root: Path) -> Iterator[str]:
    """`python -m http.server` over `root`; its simple index's URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                               str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).status == 200, "the mirror",
                 timeout=30, procs=[server])
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        server.kill()
        server.wait(timeout=30)


def _publish(root: Path, wheel: Path) -> None:
    """`wheel` on the mirror: its file, and the project's PEP 691 page pointing at it."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    (root / "files" / wheel.name).write_bytes(wheel.read_bytes())
    page = root / "simple" / "fake-pkg"
    page.mkdir(parents=True, exist_ok=True)
    (page / "index.html").write_text(json.dumps({"meta": {"api-version": "1.1"}, "files": [
        {"filename": wheel.name, "url": f"../../files/{wheel.name}", "hashes": {}}]}))


def _honest_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_pkg/model.gguf", PAYLOAD)
    return wheel


def _model(wheel: Path) -> ZooModel:
    part = WheelPart("fake-pkg", "1.0", "fake_pkg/model.gguf", sha256_digest(wheel), wheel.stat().st_size)
    return ZooModel(name="fake-model", parts=(part,), filename="model.gguf", description="test",
                    sha256=hashlib.sha256(PAYLOAD).hexdigest())


def test_a_mirror_that_sends_more_than_the_pin_fills_no_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(_honest_wheel(tmp_path / "built"))
    hostile = tmp_path / "hostile" / "fake_pkg-1.0-py3-none-any.whl"
    hostile.parent.mkdir()
    hostile.write_bytes(b"\0" * (32 << 20))  # 32 MiB where a few KB are pinned
    _publish(tmp_path / "mirror", hostile)
    with _mirror(tmp_path / "mirror") as index:
        monkeypatch.setenv("PIP_INDEX_URL", index)
        with pytest.raises(ZooError, match=f"sent more than the pinned {model.parts[0].size} bytes"):
            fetch(model, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*")) == [".lock"]  # no wheel, no partial file


def test_an_honest_mirrors_wheel_is_downloaded_checked_and_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _honest_wheel(tmp_path / "built")
    model = _model(wheel)
    _publish(tmp_path / "mirror", wheel)
    with _mirror(tmp_path / "mirror") as index:
        monkeypatch.setenv("PIP_INDEX_URL", index)
        path = fetch(model, tmp_path / "cache")
    assert path.read_bytes() == PAYLOAD
    assert (tmp_path / "cache" / wheel.name).read_bytes() == wheel.read_bytes()
