"""Unit tests are pure: no sockets, no processes. This fixture makes that a rule rather than a habit.

`make` builds real tiny learners in-process, for the tests of the learner's checks (test_verification.py and
the tests beside it)."""

from __future__ import annotations

import multiprocessing.process
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest
import zmq
from test_learner_core import run_config

from grpo_fleet.learner.run.coordinator import RunCoordinator
from in_process import build_learner


def _refuse(what: str) -> Any:
    def refused(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise AssertionError(f"a unit test tried to {what}; tests that need it belong in tests/integration/")

    return refused


@pytest.fixture(autouse=True)
def no_sockets_or_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # bind/connect, not socket creation: mlx-lm and asyncio make socketpairs that never leave the process.
    monkeypatch.setattr(socket.socket, "bind", _refuse("bind a socket"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("connect a socket"))
    monkeypatch.setattr(zmq.Socket, "bind", _refuse("bind a ZeroMQ socket"))
    monkeypatch.setattr(zmq.Socket, "connect", _refuse("connect a ZeroMQ socket"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _probes_only(subprocess.Popen.__init__))
    # multiprocessing's spawn and forkserver start children without subprocess.Popen: every context's
    # Process (pools and ProcessPoolExecutor included) starts through BaseProcess.start.
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("start a process (multiprocessing)"))


# Read-only system probes the standard library and the doctor run (platform.processor() runs uname).
PROBES = {"uname", "ldconfig", "sysctl", "nproc"}


def _probes_only(start: Any) -> Any:
    def guarded(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        if Path(str(program)).name not in PROBES:
            _refuse(f"start a process ({program})")()
        start(self, args, *rest, **kwargs)

    return guarded


@pytest.fixture
def make(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., RunCoordinator]]:
    """Returns `build(**sections)`: a real tiny learner (no sockets, no processes) with the unit tests' run config
    and these sections over it, each in a run directory of its own; all are closed after the test."""
    built: list[RunCoordinator] = []

    def build(**sections: dict) -> RunCoordinator:
        built.append(build_learner(run_config(tiny_model_dir, tmp_path / f"run{len(built)}", **sections)))
        return built[-1]

    yield build
    for learner in built:
        learner.close()
