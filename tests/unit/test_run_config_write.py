"""RUN_DIR/config.json is replaced atomically: a write that fails half-way (a full disk) leaves the previous
config, which `--resume` reads, whole."""

from __future__ import annotations

import builtins
import errno
import io
from pathlib import Path
from typing import Any

import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.run.build import load_resume_config, write_run_config


class _HalfWritten:
    """A file whose disk fills half-way through the first write: half the bytes land, then ENOSPC."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def write(self, data: Any) -> int:
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> "_HalfWritten":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()


def _disk_fills_under(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file opened for writing under `folder` fails half-way (builtins.open and io.open: Path.write_text's)."""
    real_open = builtins.open

    def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        writing = any(flag in mode for flag in "wax+")
        return _HalfWritten(handle) if writing and str(folder) in str(file) else handle

    monkeypatch.setattr(builtins, "open", opener)
    monkeypatch.setattr(io, "open", opener)


def test_a_write_that_fails_half_way_leaves_the_previous_config_whole(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = RunConfig.model_validate({"run_dir": str(run_dir), "train": {"steps": 7}})
    write_run_config(run_dir, first)
    before = (run_dir / "config.json").read_bytes()
    second = RunConfig.model_validate({"run_dir": str(run_dir), "train": {"steps": 9}})
    _disk_fills_under(run_dir, monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write_run_config(run_dir, second)
    monkeypatch.undo()
    assert (run_dir / "config.json").read_bytes() == before
    assert load_resume_config(str(run_dir)).train.steps == 7  # the next --resume still reads it
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json"]  # no half-written copy left beside it
    write_run_config(run_dir, second)
    assert load_resume_config(str(run_dir)).train.steps == 9
