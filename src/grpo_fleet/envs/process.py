"""Environments in a child process of the actor, beside the rewards' (tasks/reward_runner.py), under timeouts.

An environment is user code, like a reward: it may raise, hang, or crash its
process. Each call runs under a SIGALRM timer (`EnvSetup.timeout_seconds`), which
interrupts Python code; a call that blocks the timer too is caught by the
parent's deadline for the whole batch, which kills the child. Either way the
episodes it held fail (their groups go back unscored) and the next batch starts
a fresh child: the actor never crashes for an environment. Spawned, not forked:
MLX and ZeroMQ state must not be copied.
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from grpo_fleet.envs.hosting import EnvAnswer, EnvCalls, EnvHost, EnvTimeout, batch_deadline, lost
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup
from grpo_fleet.tasks.reward_runner import sigint_ignored

STARTUP_SECONDS = 120.0  # importing the environment's module (and what it imports)


class EnvsRefused(RuntimeError):
    """The environment cannot be loaded here: a missing module, an import error, no such class."""


class _CallTimeout(BaseException):
    """Raised by the timer; a BaseException so an environment's own `except Exception` cannot swallow it."""


def _alarm(_signum: int, _frame: Any) -> None:
    raise _CallTimeout()


def _serve(conn: Connection, setup: EnvSetup) -> None:
    """The child's loop: load the class, then answer each batch of calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops this process; Ctrl-C is the parent's to handle
    try:
        host = EnvHost(setup)
    except EnvLoadError as exc:
        conn.send(("refused", str(exc)))
        return
    signal.signal(signal.SIGALRM, _alarm)

    def guard(call: Callable[[], Any]) -> Any:
        signal.setitimer(signal.ITIMER_REAL, setup.timeout_seconds)
        try:
            return call()
        except _CallTimeout:
            raise EnvTimeout(f"ran past {setup.timeout_seconds:g}s (task.env_timeout_seconds)") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    conn.send(("ready", ""))
    while True:
        try:
            calls = conn.recv()
            conn.send(host.run(calls, guard))
        except (EOFError, OSError):  # the parent went away
            return


Child = tuple[multiprocessing.process.BaseProcess, Connection]


def _spawn(setup: EnvSetup) -> Child:
    """A child serving `setup`, once it has loaded the environment class; EnvsRefused if it cannot."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_serve, args=(child, setup), daemon=True, name="grpo-fleet-envs")
    with sigint_ignored():  # as the rewards' process: a Ctrl-C is the parent's to handle
        process.start()
    child.close()
    try:
        status, detail = parent.recv() if parent.poll(STARTUP_SECONDS) else ("refused", "no answer at startup")
    except EOFError:
        status, detail = "refused", "the environment process died while loading the environment"
    if status != "ready":
        _stop((process, parent))
        raise EnvsRefused(detail)
    return process, parent


def _stop(child: Child) -> None:
    process, conn = child
    conn.close()
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


class EnvProcess:
    """The environment host in a child process; a dead or hung child is replaced at the next batch."""

    def __init__(self, setup: EnvSetup) -> None:
        self.setup = setup
        self.restarts = 0
        self.child: Optional[Child] = _spawn(setup)

    def run_envs(self, calls: EnvCalls) -> list[EnvAnswer]:
        """One answer per call, in order; if the child hangs or dies, every call of the batch fails."""
        if self.child is None or not self.child[0].is_alive():
            self.close()
            try:
                self.child = _spawn(self.setup)
            except EnvsRefused as exc:
                return lost(calls, f"the environment process could not be restarted: {exc}")
            self.restarts += 1
        conn = self.child[1]
        deadline = batch_deadline(calls, self.setup.timeout_seconds)
        try:
            conn.send(calls)
            if conn.poll(deadline):
                answers: list[EnvAnswer] = conn.recv()
                return answers
            detail = f"no answer within {deadline:g}s (an environment blocked its own timeout); the process was restarted"
        except (EOFError, OSError):
            detail = "the environment process died (an environment crashed it); it was restarted"
        self.close()
        return lost(calls, detail)

    def close(self) -> None:
        if self.child is not None:
            _stop(self.child)
        self.child = None
