"""Environments in a child process of the actor, beside the rewards' (tasks/reward_runner.py), under timeouts; and
of the learner, which replays deterministic environments' episodes in one (learner/verify/env_replay.py).

An environment is user code, like a reward: it may raise, hang, or crash its
process. The child runs calls side by side (envs/pool.py: worker threads, an
event loop for `async def` methods, each episode's calls in order), and answers
each as it finishes: the parent submits calls and collects answers without
waiting for them (`submit`, `collect`), so a slow tool holds only its own
episode. A call past `EnvSetup.timeout_seconds` is interrupted and answered as
a timeout; a child that answers nothing for longer than that while calls wait
(a call blocked in C, a crash) is killed. Either way the episodes it held fail
(their groups go back unscored) and the next call starts a fresh child: the
actor never crashes for an environment. Spawned, not forked: MLX and ZeroMQ
state must not be copied.

A caller may also cap how long it waits for one batch (`run_envs`' max_seconds):
the learner's replay does, so the actor whose episodes it replays can hold it
no longer than security.replay_seconds.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections import Counter, deque
from multiprocessing.connection import Connection
from typing import Optional

from grpo_fleet.envs.hosting import BATCH_SLACK_SECONDS, EnvAnswer, EnvCall, EnvCalls, EnvHost, batch_deadline, lost
from grpo_fleet.envs.pool import ConcurrentHost
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup
from grpo_fleet.tasks.reward_runner import sigint_ignored

STARTUP_SECONDS = 120.0  # importing the environment's module (and what it imports)
CLOSED = "the environment process is closed (the learner or actor is stopping)"


class EnvsRefused(RuntimeError):
    """The environment cannot be loaded here: a missing module, an import error, no such class."""


# How often the child looks for calls past their timeout, and for answers to send, while nothing arrives.
CHILD_TICK_SECONDS = 0.01
STUCK_EXIT_CODE = 3


def _serve(conn: Connection, setup: EnvSetup) -> None:
    """The child's loop: load the class, then take calls as they come and send each answer as it is ready."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops this process; Ctrl-C is the parent's to handle
    try:
        host = ConcurrentHost(EnvHost(setup), setup.concurrency, setup.timeout_seconds)
    except EnvLoadError as exc:
        conn.send(("refused", str(exc)))
        return
    conn.send(("ready", ""))
    try:
        while True:
            if conn.poll(CHILD_TICK_SECONDS):
                calls: EnvCalls = conn.recv()
                host.submit(calls.calls)
            if not host.expire():  # too many calls stuck in C: a fresh process is the only way out
                raise SystemExit(STUCK_EXIT_CODE)
            answers = _drain(host)
            if answers:
                conn.send(answers)
    except (EOFError, OSError):  # the parent went away
        return


def _drain(host: ConcurrentHost) -> list[EnvAnswer]:
    answers = []
    while not host.finished.empty():
        answers.append(host.finished.get_nowait())
    return answers


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
    """The environment host in a child process; a dead or hung child is replaced at the next call.

    Calls are submitted and their answers collected as they come (`submit`,
    `collect`), or a batch is run to its end (`run_envs`). `close` may come from
    another thread while calls are in flight (the learner stopping while a replay
    hangs): it kills the child, so they fail at once instead of running to their
    deadline, and no call after it starts one.
    """

    def __init__(self, setup: EnvSetup) -> None:
        self.setup = setup
        self.restarts = 0
        self.closed = False
        self._lock = threading.Lock()  # `close` cleans up after a caller in flight
        self._pending: dict[int, deque[EnvCall]] = {}  # calls sent and not answered, by episode
        self._answered: list[EnvAnswer] = []  # answers not collected yet
        self._heard = time.monotonic()  # when the child last answered (or was sent work while idle)
        self.child: Optional[Child] = _start(setup)
        _await_ready(self.child)

    def submit(self, calls: EnvCalls) -> None:
        """Send calls to the child without waiting; their answers come from `collect` (a failed start's at once)."""
        with self._lock:
            if self.child is None or not self.child[0].is_alive():
                refused = self._restart()
                if refused:
                    self._answered += lost(calls, refused)
                    return
            assert self.child is not None
            if not self._pending:
                self._heard = time.monotonic()
            for call in calls.calls:
                self._pending.setdefault(call.episode, deque()).append(call)
            try:
                self.child[1].send(calls)
            except (EOFError, OSError):
                self._fail_pending(CLOSED if self.closed else "the environment process died; it was restarted")

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]:
        """The answers ready now, waiting up to `wait_seconds` for a first one; a child silent past a call's timeout
        while calls wait is killed, and those calls fail."""
        with self._lock:
            if self.child is not None and self._pending:
                self._receive(self.child[1], wait_seconds)
            answered, self._answered = self._answered, []
            return answered

    def run_envs(self, calls: EnvCalls, max_seconds: Optional[float] = None) -> list[EnvAnswer]:
        """One answer per call, in order; if the child hangs or dies, every call still waiting fails.

        `max_seconds`: the most to wait for the batch (its calls' summed timeouts by default); past it the
        child is killed, as for a hang."""
        wait = batch_deadline(calls, self.setup.timeout_seconds)
        limit = wait if max_seconds is None else min(wait, max_seconds)
        deadline = time.monotonic() + limit
        self.submit(calls)
        found: dict[int, deque[EnvAnswer]] = {}
        expected = Counter(call.episode for call in calls.calls)
        outstanding = len(calls.calls)
        while outstanding:
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self._drop()
                    self._fail_pending(f"no answer within {limit:g}s (an environment blocked its own timeout, or "
                                       "the batch ran past its deadline); the process was killed", "timeout")
            for answer in self.collect(min(max(left, 0.0), 0.1)):
                if expected[answer.episode]:  # else a call submitted before, by a caller that gave up on it
                    expected[answer.episode] -= 1
                    found.setdefault(answer.episode, deque()).append(answer)
                    outstanding -= 1
        return [found[call.episode].popleft() for call in calls.calls]

    def _receive(self, conn: Connection, wait_seconds: float) -> None:
        try:
            if conn.poll(wait_seconds):
                while True:
                    for answer in conn.recv():
                        self._settle(answer)
                    self._heard = time.monotonic()
                    if not conn.poll(0):
                        return
            if time.monotonic() - self._heard > self.setup.timeout_seconds + BATCH_SLACK_SECONDS:
                self._drop()
                self._fail_pending(f"no answer within {self.setup.timeout_seconds:g}s (an environment blocked its "
                                   "own timeout); the process was killed", "timeout")
        except (EOFError, OSError):
            self._drop()
            self._fail_pending(CLOSED if self.closed else
                               "the environment process died (an environment crashed it); it was restarted")

    def _settle(self, answer: EnvAnswer) -> None:
        calls = self._pending.get(answer.episode)
        if calls:
            calls.popleft()
            if not calls:
                del self._pending[answer.episode]
        self._answered.append(answer)

    def _fail_pending(self, detail: str, kind: str = "crashed") -> None:
        waiting = [call for calls in self._pending.values() for call in calls]
        self._pending.clear()
        self._answered += lost(EnvCalls(waiting), detail, kind)  # type: ignore[arg-type]  # a FailureKind

    def _restart(self) -> str:
        """A fresh child for the next calls; why not, when it cannot have one."""
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

    def _drop(self) -> None:
        if self.child is not None:
            _stop(self.child)
        self.child = None

    def close(self) -> None:
        """Stop the child for good (from any thread: calls in flight fail at once, as its child is killed)."""
        self.closed = True
        child = self.child
        if child is not None and child[0].is_alive():
            child[0].kill()
        with self._lock:  # a caller in flight, if any, ends now: its child is gone
            self._drop()
            self._fail_pending(CLOSED)
