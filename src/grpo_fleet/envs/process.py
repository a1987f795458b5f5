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

The child itself (spawning, the ready handshake, kill and restart, Ctrl-C left
to the parent) is runtime/child.py's guarded child, which the rewards' process
shares.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from multiprocessing.connection import Connection
from typing import Optional

from grpo_fleet.envs.hosting import BATCH_SLACK_SECONDS, EnvAnswer, EnvCall, EnvCalls, EnvHost, batch_deadline, lost
from grpo_fleet.envs.pool import ConcurrentHost
from grpo_fleet.runtime.child import ChildDied, ChildRefused, ChildSpec, GuardedChild
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup

CLOSED = "the environment process is closed (the learner or actor is stopping)"
DIED = "the environment process died (an environment crashed it); it was restarted"


class EnvsRefused(ChildRefused):
    """The environment cannot be loaded here: a missing module, an import error, no such class."""


# How often the child looks for calls past their timeout, and for answers to send, while nothing arrives.
CHILD_TICK_SECONDS = 0.01
STUCK_EXIT_CODE = 3


def _load(setup: EnvSetup) -> ConcurrentHost:
    try:
        return ConcurrentHost(EnvHost(setup), setup.concurrency, setup.timeout_seconds)
    except EnvLoadError as exc:
        raise EnvsRefused(str(exc)) from exc


def _serve(conn: Connection, host: ConcurrentHost) -> None:
    """The child's loop: take calls as they come and send each answer as it is ready."""
    while True:
        if conn.poll(CHILD_TICK_SECONDS):
            calls: EnvCalls = conn.recv()
            host.submit(calls.calls)
        if not host.expire():  # too many calls stuck in C: a fresh process is the only way out
            raise SystemExit(STUCK_EXIT_CODE)
        answers = _drain(host)
        if answers:
            conn.send(answers)


def _drain(host: ConcurrentHost) -> list[EnvAnswer]:
    answers = []
    while not host.finished.empty():
        answers.append(host.finished.get_nowait())
    return answers


class EnvProcess:
    """The environment host in a guarded child process (runtime/child.py); a dead or hung child is replaced at the
    next call.

    Calls are submitted and their answers collected as they come (`submit`,
    `collect`), or a batch is run to its end (`run_envs`). `close` may come from
    another thread while calls are in flight (the learner stopping while a replay
    hangs): it kills the child, so they fail at once instead of running to their
    deadline, and no call after it starts one.
    """

    def __init__(self, setup: EnvSetup) -> None:
        self.setup = setup
        self._lock = threading.Lock()  # `close` cleans up after a caller in flight
        self._pending: dict[int, deque[EnvCall]] = {}  # calls sent and not answered, by episode
        self._answered: list[EnvAnswer] = []  # answers not collected yet
        self._heard = time.monotonic()  # when the child last answered (or was sent work while idle)
        self.child = GuardedChild(ChildSpec("grpo-fleet-envs", "the environment process", "the environment", _load,
                                            _serve, setup, refused=EnvsRefused))

    @property
    def restarts(self) -> int:
        return self.child.restarts

    def submit(self, calls: EnvCalls) -> None:
        """Send calls to the child without waiting; their answers come from `collect` (a failed start's at once)."""
        with self._lock:
            if not self.child.running:
                refused = self._restart()
                if refused:
                    self._answered += lost(calls, refused)
                    return
            if not self._pending:
                self._heard = time.monotonic()
            for call in calls.calls:
                self._pending.setdefault(call.episode, deque()).append(call)
            try:
                self.child.send(calls)
            except ChildDied:
                self._fail_pending(CLOSED if self.child.closed else "the environment process died; it was restarted")

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]:
        """The answers ready now, waiting up to `wait_seconds` for a first one; a child silent past a call's timeout
        while calls wait is killed, and those calls fail."""
        with self._lock:
            if self._pending:
                self._receive(wait_seconds)
            answered, self._answered = self._answered, []
            return answered

    def run_envs(self, calls: EnvCalls, max_seconds: Optional[float] = None) -> list[EnvAnswer]:
        """One answer per call, in order; if the child hangs or dies, every call still waiting fails.

        `max_seconds`: the most to wait for the batch (its calls' summed timeouts by default), from when the
        child has it (a fresh child's start is not the calls' time); past it the child is killed, as for a hang."""
        wait = batch_deadline(calls, self.setup.timeout_seconds)
        limit = wait if max_seconds is None else min(wait, max_seconds)
        self.submit(calls)
        deadline = time.monotonic() + limit
        found: dict[int, deque[EnvAnswer]] = {}
        expected = Counter(call.episode for call in calls.calls)
        outstanding = len(calls.calls)
        while outstanding:
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self.child.kill()
                    self._fail_pending(f"no answer within {limit:g}s (an environment blocked its own timeout, or "
                                       "the batch ran past its deadline); the process was killed", "timeout")
            for answer in self.collect(min(max(left, 0.0), 0.1)):
                if expected[answer.episode]:  # else a call submitted before, by a caller that gave up on it
                    expected[answer.episode] -= 1
                    found.setdefault(answer.episode, deque()).append(answer)
                    outstanding -= 1
        return [found[call.episode].popleft() for call in calls.calls]

    def _receive(self, wait_seconds: float) -> None:
        try:
            answers = self.child.answers(wait_seconds)
        except ChildDied:
            self._fail_pending(CLOSED if self.child.closed else DIED)
            return
        for batch in answers:
            for answer in batch:
                self._settle(answer)
        if answers:
            self._heard = time.monotonic()
        elif time.monotonic() - self._heard > self.setup.timeout_seconds + BATCH_SLACK_SECONDS:
            self.child.kill()
            self._fail_pending(f"no answer within {self.setup.timeout_seconds:g}s (an environment blocked its "
                               "own timeout); the process was killed", "timeout")

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
        """A fresh child for the next calls, once the dead one's answers are in and its other calls failed; why
        not, when it cannot have one."""
        if self._pending:
            self._receive(0.0)  # what it answered before it died
            self._fail_pending(CLOSED if self.child.closed else DIED)
        try:
            self.child.restart()
        except EnvsRefused as exc:
            return CLOSED if self.child.closed else f"the environment process could not be restarted: {exc}"
        return ""

    def close(self) -> None:
        """Stop the child for good (from any thread: calls in flight fail at once, as its child is killed)."""
        self.child.close()
        with self._lock:  # a caller in flight, if any, ends now: its child is gone
            self._fail_pending(CLOSED)
