"""An actor asked to stop finishes or drops its lease quietly, whatever order it and its reward process die in.

`grpo-fleet demo` and `grpo-fleet launch` stop an actor with SIGTERM to its whole
process group, which reaches its reward process too; a user may also kill either
one alone. The actor's next score() then met a dead pipe: a BrokenPipeError
traceback in its log and exit code 1, which a launcher restarts as a crash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from grpo_fleet.runtime.blas import child_env
from helpers import jsonl, reward_children, wait_for


def _gone(pid: int, within: float = 10.0) -> None:
    """Wait until `pid` is dead: gone, or a zombie (its pipes closed, its parent not yet told)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
        if not state.strip() or state.strip().startswith("Z"):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} is still running")


def _steps(run_dir: Path) -> int:
    return len(jsonl(run_dir / "metrics.jsonl"))


def _stop(actor, order: str, run_dir: Path) -> None:
    """Stop the actor and its reward process, in `order`."""
    (rewards,) = wait_for(lambda: reward_children(actor.pid), "the actor's reward process", procs=[actor])
    if order == "rewards first":
        os.kill(rewards, signal.SIGTERM)
        _gone(rewards)
        # Two more steps: the actor has scored a lease since (it died of BrokenPipeError there).
        reached = _steps(run_dir) + 2
        wait_for(lambda: _steps(run_dir) >= reached, "2 steps after the reward process died", procs=[actor])
        os.kill(actor.pid, signal.SIGTERM)
    elif order == "together":  # what grpo-fleet demo and launch do
        os.killpg(actor.pid, signal.SIGTERM)
    else:
        os.kill(actor.pid, signal.SIGTERM)
        time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # the actor may have finished and stopped it already
            os.kill(rewards, signal.SIGTERM)


@pytest.mark.parametrize("order", ["rewards first", "together", "actor first"])
def test_an_actor_stops_quietly_whatever_order_its_processes_die_in(run_config, spawn, order: str) -> None:
    config, cfg = run_config(train={"steps": 100000})
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "a0", "--metrics-port", "0",
                  "--model-dir", str(run_dir), name="actor")
    wait_for(lambda: _steps(run_dir) >= 2, "2 steps", procs=[learner, actor])
    _stop(actor, order, run_dir)
    code = actor.wait(timeout=60)
    log = actor.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "Error" not in log, log[-3000:]
    assert "unscored" not in log, "a stop charged a group to the reward as a crash"
    assert "actor a0 stopping: signal" in log, log[-3000:]
    assert learner.poll() is None


@dataclass
class _LifelineFleet:
    learner: subprocess.Popen
    actor: subprocess.Popen
    log: Path
    run_dir: Path

    def steps(self) -> int:
        return _steps(self.run_dir)


@contextlib.contextmanager
def _lifeline_fleet(run_config, spawn, tmp_path: Path, stdin: int) -> Iterator[_LifelineFleet]:
    """A learner, and an actor with --stdin-lifeline whose stdin is `stdin`; the actor killed if it outlives the test."""
    config, cfg = run_config(train={"steps": 100000})
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    log = tmp_path / "lifeline-actor.log"
    with open(log, "w") as out:
        actor = subprocess.Popen(
            [sys.executable, "-m", "grpo_fleet", "actor", "--connect", cfg.server.bind, "--actor-id", "a1",
             "--metrics-port", "0", "--model-dir", str(run_dir), "--stdin-lifeline"],
            stdin=stdin, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    try:
        yield _LifelineFleet(learner, actor, log, run_dir)
    finally:
        if actor.poll() is None:
            os.killpg(actor.pid, signal.SIGKILL)
            actor.wait()


def test_an_actor_with_a_lifeline_stops_in_order_when_its_stdin_ends(run_config, spawn, tmp_path: Path) -> None:
    """How `grpo-fleet launch` stops an actor over ssh: it closes the actor's stdin (ssh forwards the end)."""
    with _lifeline_fleet(run_config, spawn, tmp_path, subprocess.PIPE) as fleet:
        wait_for(lambda: fleet.steps() >= 2, "2 steps", procs=[fleet.learner, fleet.actor])
        assert fleet.actor.stdin is not None
        fleet.actor.stdin.close()
        assert fleet.actor.wait(timeout=60) == 0, fleet.log.read_text()[-3000:]
    text = fleet.log.read_text()
    assert "stdin closed" in text and "actor a1 stopping: signal" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_lifeline_on_dev_null_is_ignored_not_a_stop(run_config, spawn, tmp_path: Path) -> None:
    """`ssh -n`, or a template that forwards no stdin: EOF at once would stop the actor before it worked."""
    with _lifeline_fleet(run_config, spawn, tmp_path, subprocess.DEVNULL) as fleet:
        wait_for(lambda: "joined run" in fleet.log.read_text(), "the actor joined", procs=[fleet.learner, fleet.actor])
        steps = fleet.steps()
        wait_for(lambda: fleet.steps() >= steps + 2, "2 more steps", procs=[fleet.learner, fleet.actor])
        assert "--stdin-lifeline ignored: stdin is closed or /dev/null" in fleet.log.read_text()
