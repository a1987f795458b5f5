"""Environments in a child process of the actor, beside the rewards' (tasks/reward_runner.py), under timeouts; and
of the learner, which replays deterministic environments' episodes in one (learner/door/env_replay.py).

An environment is user code, like a reward: it may raise, hang, or crash its
process. Each call runs under a SIGALRM timer (`EnvSetup.timeout_seconds`), which
interrupts Python code; a call that blocks the timer too is caught by the
parent's deadline for the whole batch, which kills the child. Either way the
episodes it held fail (their groups go back unscored) and the next batch starts
a fresh child: the actor never crashes for an environment. Spawned, not forked:
MLX and ZeroMQ state must not be copied.

A caller may also cap how long it waits for one batch (`run_envs`' max_seconds):
the learner's replay does, so the actor whose episodes it replays can hold it
no longer than security.replay_seconds.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from grpo_fleet.envs.hosting import EnvAnswer, EnvCalls, EnvHost, EnvTimeout, batch_deadline, lost
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup
from grpo_fleet.tasks.reward_runner import sigint_ignored

STARTUP_SECONDS = 120.0  # importing the environment's module (and what it imports)
CLOSED = "the environment process is closed (the learner or actor is stopping)"


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


def _start(setup: EnvSetup) -> Child:
    """A child starting to serve `setup` (it says "ready" once it has loaded the environment class)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_serve, args=(child, setup), daemon=True, name="grpo-fleet-envs")
    with sigint_ignored():  # as the rewards' process: a Ctrl-C is the parent's to handle
        process.start()
    child.close()
    return process, parent


def _await_ready(child: Child) -> None:
    """Wait for a started child to load the environment class; EnvsRefused (the child stopped) if it cannot."""
    try:
        status, detail = child[1].recv() if child[1].poll(STARTUP_SECONDS) else ("refused", "no answer at startup")
    except (EOFError, OSError):
        status, detail = "refused", "the environment process died while loading the environment"
    if status != "ready":
        _stop(child)
        raise EnvsRefused(detail)


def _stop(child: Child) -> None:
    process, conn = child
    conn.close()
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


class EnvProcess:
    """The environment host in a child process; a dead or hung child is replaced at the next batch.

    `close` may come from another thread while a batch is in flight (the learner
    stopping while a replay hangs): it kills the child, so that batch fails at
    once instead of running to its deadline, and no batch after it starts one.
    """

    def __init__(self, setup: EnvSetup) -> None:
        self.setup = setup
        self.restarts = 0
        self.closed = False
        self._in_flight = threading.Lock()  # one batch at a time; `close` cleans up after the one in flight
        self.child: Optional[Child] = _start(setup)
        _await_ready(self.child)

    def run_envs(self, calls: EnvCalls, max_seconds: Optional[float] = None) -> list[EnvAnswer]:
        """One answer per call, in order; if the child hangs or dies, every call of the batch fails.

        `max_seconds`: the most to wait for the batch (its calls' summed timeouts by default); past it the
        child is killed, as for a hang."""
        with self._in_flight:
            if self.child is None or not self.child[0].is_alive():
                refused = self._restart()
                if refused:
                    return lost(calls, refused)
            assert self.child is not None
            wait = batch_deadline(calls, self.setup.timeout_seconds)
            return self._exchange(self.child[1], calls, wait if max_seconds is None else min(wait, max_seconds))

    def _restart(self) -> str:
        """A fresh child for the next batch; why not, when it cannot have one."""
        self._drop()
        if self.closed:
            return CLOSED
        self.child = _start(self.setup)
        try:
            _await_ready(self.child)
        except EnvsRefused as exc:
            self.child = None
            return CLOSED if self.closed else f"the environment process could not be restarted: {exc}"
        if self.closed:  # closed while it started: `close` may have missed it
            self._drop()
            return CLOSED
        self.restarts += 1
        return ""

    def _exchange(self, conn: Connection, calls: EnvCalls, wait: float) -> list[EnvAnswer]:
        try:
            conn.send(calls)
            if conn.poll(wait):
                answers: list[EnvAnswer] = conn.recv()
                return answers
            self._drop()
            return lost(calls, f"no answer within {wait:g}s (an environment blocked its own timeout, or the batch ran "
                               "past its deadline); the process was killed", "timeout")
        except (EOFError, OSError):
            detail = CLOSED if self.closed else "the environment process died (an environment crashed it); it was restarted"
        self._drop()
        return lost(calls, detail)

    def _drop(self) -> None:
        if self.child is not None:
            _stop(self.child)
        self.child = None

    def close(self) -> None:
        """Stop the child for good (from any thread: a batch in flight fails at once, as its child is killed)."""
        self.closed = True
        child = self.child
        if child is not None and child[0].is_alive():
            child[0].kill()
        with self._in_flight:  # the batch in flight, if any, ends now: its child is gone
            self._drop()
