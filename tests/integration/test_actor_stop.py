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
import time
from pathlib import Path

import pytest

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
