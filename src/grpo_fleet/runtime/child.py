"""One guarded child process: user code runs where it may raise, hang or crash at the cost of a call, never of its
parent.

Rewards (tasks/reward_runner.py) and environments (envs/process.py: the actor's, and the learner's replay of
deterministic ones, learner/verify/env_replay.py) are user code. Each runs in a child that this module starts and
guards; a client says only what the child loads, how it serves, and what a failure means to it.

- Spawned, never forked: the parent's MLX and ZeroMQ state must not be copied.
- The ready handshake: the child loads what it serves (an import may take a while: math-verify brings sympy)
  within `ChildSpec.load_seconds`, then says "ready", or why not, which the parent raises as the client's own
  refusal. A child killed by a signal while it loads (the OOM killer, a stop sent to its process group) says
  nothing of what it loads: a fresh one is tried, START_ATTEMPTS in all.
- Requests and answers are pickled over one pipe. The parent waits no longer than the deadline it names
  (`receive`): past it the child, hung where no timer reaches (a call blocked in C), is killed. In the child,
  `call_deadline` interrupts one call's Python code with a timer.
- A dead or killed child is replaced when its client next needs one (`restart`); `restarts` counts them.
- SIGINT is ignored in the child from its first instruction: Ctrl-C reaches the whole foreground process group,
  and the child must outlive it until its parent, shutting down in order, stops it.
- `close` stops the child for good, from any thread: a caller waiting on it sees it die at once, and no restart
  follows.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional

log = logging.getLogger("grpo_fleet.child")
LOAD_SECONDS = 120.0
# Starts tried when a child is killed by a signal while it loads, before what it loads is refused.
START_ATTEMPTS = 3
# A child that died of one of these was stopped from outside (a stop sent to its process group, a hangup), not by
# the request it held.
STOPPED_FROM_OUTSIDE = (-signal.SIGTERM, -signal.SIGHUP)
REAP_SECONDS = 1.0  # a child whose pipe just closed is dying: reaped, its exit code says how
KILL_REAP_SECONDS = 5.0


class ChildRefused(RuntimeError):
    """The child cannot serve: what it loads failed (a missing module, an import error), or it would not start."""


class ChildDied(Exception):
    """The child's pipe closed: it died or was killed (or none is held: it was stopped, or closed)."""

    def __init__(self, exitcode: Optional[int]) -> None:
        super().__init__(f"the child process died (exit code {exitcode})")
        self.exitcode = exitcode

    @property
    def stopped_from_outside(self) -> bool:
        """Whether a stop signal ended it (SIGTERM, SIGHUP), rather than the request it held."""
        return self.exitcode in STOPPED_FROM_OUTSIDE


class ChildSilent(Exception):
    """No answer within the parent's deadline: the child was killed."""


class CallTimedOut(BaseException):
    """Raised in the child by `call_deadline`'s timer; a BaseException, so user code's `except Exception` cannot
    swallow it."""


@dataclass(frozen=True)
class ChildSpec:
    """What a child runs. `load` and `serve` are module-level functions: the spawned child imports them by name."""

    name: str  # the process's name, as `ps` shows it
    label: str  # how messages name the process: "the reward process"
    loads: str  # what it loads, for messages: "the rewards"
    load: Callable[[Any], Any]  # payload -> what `serve` serves; raises ChildRefused (a subclass) to refuse
    serve: Callable[[Connection, Any], None]  # answers the pipe's requests until the parent goes away
    payload: Any
    refused: type[ChildRefused] = ChildRefused  # what the parent raises when the child refuses, or will not start
    load_seconds: float = LOAD_SECONDS


# ---------------------------------------------------------------------- in the child


def _main(conn: Connection, spec: ChildSpec) -> None:
    """The child: load, say whether it is ready, then serve until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops this process; Ctrl-C is the parent's to handle
    try:
        served = spec.load(spec.payload)
    except ChildRefused as exc:
        conn.send(("refused", str(exc)))
        return
    conn.send(("ready", ""))
    try:
        spec.serve(conn, served)
    except (EOFError, OSError):  # the parent went away: nobody to answer, and no traceback for its log
        return


def _ring(_signum: int, _frame: Any) -> None:
    raise CallTimedOut()


@contextlib.contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """Interrupt the Python code inside after `seconds` with CallTimedOut (a SIGALRM timer: the main thread only).

    Code that blocks the signal, or waits in C, is left to the parent's deadline, which kills the child."""
    previous = signal.signal(signal.SIGALRM, _ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------- in the parent


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a child starts, so it inherits SIG_IGN from its first instruction on.

    A spawned Python that starts with SIGINT ignored installs no KeyboardInterrupt handler of its own; before
    its first instruction, only an inherited disposition can keep Ctrl-C from killing it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions can only change in the main thread; _main ignores SIGINT itself
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class _KilledWhileLoading(Exception):
    """The child died of a signal before it was ready: not the fault of what it loads."""


class GuardedChild:
    """One child at a time, serving `spec`: started at once (the spec's refusal if it cannot be), replaced on
    `restart`, stopped for good by `close`."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.restarts = 0
        self.closed = False
        self._context = multiprocessing.get_context("spawn")
        self._process: Optional[BaseProcess] = None
        self._conn: Optional[Connection] = None
        self._lock = threading.RLock()  # `close` from another thread cleans up after the caller in flight
        with self._lock:
            self._start()

    @property
    def pid(self) -> Optional[int]:
        """The child held now, if any (it may have died since its last answer); None once stopped or closed."""
        process = self._process
        return None if process is None else process.pid

    @property
    def running(self) -> bool:
        process = self._process
        return process is not None and process.is_alive()

    def restart(self) -> None:
        """A fresh child in place of the one held, if any; the spec's refusal when none starts, or once closed."""
        with self._lock:
            code = self._process.exitcode if self._process is not None else None
            if code is not None:  # it died since its last answer: say how, stopped or killed
                log.log(logging.INFO if code in STOPPED_FROM_OUTSIDE else logging.WARNING,
                        "%s had died (exit code %s); starting a fresh one", self.spec.label, code)
            self._drop()
            self._start()
            self.restarts += 1

    def send(self, request: Any) -> None:
        """Hand the child a request; ChildDied (the child dropped) if it has died."""
        with self._lock:
            conn = self._held()
            try:
                conn.send(request)
            except OSError:  # BrokenPipeError, ConnectionResetError: it died just now
                raise self._died() from None

    def receive(self, seconds: float) -> Any:
        """The next answer, within `seconds`: past them the child is killed (ChildSilent); ChildDied if it died."""
        with self._lock:
            conn = self._held()
            try:
                if conn.poll(seconds):
                    return conn.recv()
            except (EOFError, OSError):
                raise self._died() from None
            self._drop()
            raise ChildSilent(f"no answer within {seconds:g}s")

    def answers(self, wait_seconds: float) -> list[Any]:
        """Every answer ready now, waiting up to `wait_seconds` for a first; ChildDied if it died before any."""
        with self._lock:
            conn = self._held()
            ready: list[Any] = []
            try:
                if conn.poll(wait_seconds):
                    ready.append(conn.recv())
                    while conn.poll(0):
                        ready.append(conn.recv())
            except (EOFError, OSError):
                if not ready:  # else the next call finds it dead
                    raise self._died() from None
            return ready

    def kill(self) -> None:
        """Stop the child now (it hung, or its caller's deadline passed); `restart` starts the next one."""
        with self._lock:
            self._drop()

    def close(self) -> None:
        """Stop the child for good, from any thread: a caller waiting on it sees it die at once, and none restarts."""
        self.closed = True
        process = self._process
        if process is not None and process.is_alive():
            process.kill()  # before the lock: the caller in flight, if any, holds it until its child dies
        with self._lock:
            self._drop()

    def _start(self) -> None:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except _KilledWhileLoading as exc:
                log.warning("%s was killed while loading %s (%s); attempt %d of %d", self.spec.label,
                            self.spec.loads, exc, attempt, START_ATTEMPTS)
        raise self.spec.refused(f"{self.spec.label} was killed while loading {self.spec.loads}, "
                                f"{START_ATTEMPTS} times")

    def _start_once(self) -> None:
        if self.closed:
            raise self.spec.refused(f"{self.spec.label} is closed")
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_main, args=(child, self.spec), daemon=True, name=self.spec.name)
        with sigint_ignored():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        if self.closed:  # closed while it started: `close` may have looked before it was held
            self._drop()
            raise self.spec.refused(f"{self.spec.label} is closed")
        self._handshake(parent)

    def _handshake(self, conn: Connection) -> None:
        """Wait for a started child to say it is ready; the spec's refusal (the child stopped) if it is not."""
        try:
            ready = conn.poll(self.spec.load_seconds)
            status, detail = conn.recv() if ready else ("refused", f"{self.spec.label} did not start within "
                                                                    f"{self.spec.load_seconds:g}s")
        except (EOFError, OSError):
            code = self._died().exitcode
            if not self.closed and code is not None and code < 0:
                raise _KilledWhileLoading(f"signal {-code}") from None
            status, detail = "refused", (f"{self.spec.label} is closed" if self.closed else
                                         f"{self.spec.label} died while loading {self.spec.loads} (exit code {code})")
        if status != "ready":
            self._drop()
            raise self.spec.refused(detail)

    def _held(self) -> Connection:
        if self._conn is None:
            raise ChildDied(None)
        return self._conn

    def _died(self) -> ChildDied:
        """The child whose pipe just closed, reaped for its exit code (how it died), then dropped."""
        process = self._process
        if process is not None:
            process.join(timeout=REAP_SECONDS)
        died = ChildDied(process.exitcode if process is not None else None)
        self._drop()
        return died

    def _drop(self) -> None:
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if conn is not None:
            conn.close()
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=KILL_REAP_SECONDS)
