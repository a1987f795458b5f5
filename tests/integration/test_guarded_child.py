"""The guarded child process (runtime/child.py) that rewards and environments run in: real children, real kills.

The child here serves a few scripted requests (an echo, a hang, an exit); the rewards' and the environments' own
tests (test_reward_process.py, test_env_process.py) show the same guard under their clients.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import pytest

from grpo_fleet.runtime.child import ChildDied, ChildRefused, ChildSilent, ChildSpec, GuardedChild


class ToyRefused(ChildRefused):
    """The client's own refusal, as RewardsRefused and EnvsRefused are."""


def _load(payload: dict[str, Any]) -> str:
    """What the child loads: a refusal, a death or a slow import on demand (a marker file: the first child only)."""
    if "refuse" in payload:
        raise ToyRefused(payload["refuse"])
    if "exit" in payload:
        os._exit(payload["exit"])
    if payload.get("slow"):
        time.sleep(60)
    marker = payload.get("slow_once")
    if marker is not None and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        time.sleep(60)
    return "loaded"


def _serve(conn: Connection, loaded: str) -> None:
    while True:
        request = conn.recv()
        if request == "hang":
            time.sleep(3600)
        if request == "exit":
            os._exit(3)
        conn.send((loaded, request, os.getpid()))


def _child(load_seconds: float = 60.0, **payload: Any) -> GuardedChild:
    return GuardedChild(ChildSpec("grpo-fleet-toy", "the toy process", "the toy", _load, _serve, payload,
                                  refused=ToyRefused, load_seconds=load_seconds))


def _wait_dead(child: GuardedChild) -> None:
    deadline = time.monotonic() + 10
    while child.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not child.running


def test_a_request_is_answered_by_the_child_and_sigint_does_not_reach_it() -> None:
    child = _child()
    try:
        child.send("hi")
        loaded, echoed, pid = child.receive(30)
        assert (loaded, echoed, pid) == ("loaded", "hi", child.pid) and pid != os.getpid()
        os.kill(pid, signal.SIGINT)  # Ctrl-C reaches the whole process group: the child is its parent's to stop
        child.send("again")
        assert child.receive(30)[1:] == ("again", pid) and child.restarts == 0
    finally:
        child.close()


def test_what_cannot_load_is_refused_with_its_reason() -> None:
    with pytest.raises(ToyRefused, match="^no GPU here$"):
        _child(refuse="no GPU here")
    with pytest.raises(ToyRefused, match="died while loading the toy \\(exit code 5\\)"):
        _child(exit=5)


def test_a_load_past_its_deadline_is_refused_and_the_child_killed() -> None:
    started = time.monotonic()
    with pytest.raises(ToyRefused, match="did not start within 2s"):
        _child(load_seconds=2.0, slow=True)
    assert time.monotonic() - started < 30
    assert not [p for p in multiprocessing.active_children() if p.name == "grpo-fleet-toy"]


def test_a_child_killed_while_loading_is_started_again(tmp_path: Path) -> None:
    marker = tmp_path / "loading"
    killer = threading.Thread(target=_kill_when_marked, args=(marker,), daemon=True)
    killer.start()
    child = _child(slow_once=str(marker))
    try:
        killer.join()
        assert child.pid is not None and child.pid != int(marker.read_text())
        child.send("x")
        assert child.receive(30)[1] == "x"
    finally:
        child.close()


def _kill_when_marked(marker: Path) -> None:
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(int(marker.read_text()), signal.SIGKILL)


def test_a_silent_child_is_killed_at_the_deadline_and_a_restart_replaces_it() -> None:
    child = _child()
    try:
        hung = child.pid
        child.send("hang")
        started = time.monotonic()
        with pytest.raises(ChildSilent, match="no answer within 0.5s"):
            child.receive(0.5)
        assert time.monotonic() - started < 5 and child.pid is None and not child.running
        with pytest.raises(ChildDied):
            child.send("x")  # none held until the client restarts it
        child.restart()
        child.send("x")
        assert child.receive(30)[1:] == ("x", child.pid) and child.pid != hung and child.restarts == 1
    finally:
        child.close()


@pytest.mark.parametrize(("signum", "outside"), [(signal.SIGTERM, True), (signal.SIGKILL, False)], ids=["SIGTERM", "SIGKILL"])
def test_a_death_is_reported_with_how_it_died(signum: int, outside: bool) -> None:
    child = _child()
    try:
        child.send("exit")
        with pytest.raises(ChildDied) as died:
            child.receive(30)
        assert died.value.exitcode == 3 and not died.value.stopped_from_outside and child.pid is None
        child.restart()
        assert child.pid is not None
        os.kill(child.pid, signum)
        _wait_dead(child)
        with pytest.raises(ChildDied) as stopped:
            child.receive(30)
        assert stopped.value.exitcode == -signum and stopped.value.stopped_from_outside is outside
    finally:
        child.close()


def test_close_from_another_thread_ends_a_wait_at_once_and_nothing_restarts() -> None:
    child = _child()
    caught: list[Optional[BaseException]] = []

    def wait() -> None:
        try:
            child.receive(120)
            caught.append(None)
        except BaseException as exc:  # what the waiting caller sees
            caught.append(exc)

    child.send("hang")
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    stopping = time.monotonic()
    child.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and time.monotonic() - stopping < 5
    assert isinstance(caught[0], ChildDied) and child.pid is None
    with pytest.raises(ToyRefused, match="the toy process is closed"):
        child.restart()
    assert child.pid is None and child.restarts == 0
