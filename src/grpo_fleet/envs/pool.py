"""Environment calls run side by side in the environment process: a slow tool holds its own episode, not the others.

A real tool (a search, a sandboxed interpreter, a web request, a judge) takes
0.1 to 10 s. Run one call at a time, every episode of the lease waited for each
of them, and so did every decoding slot. Here each call runs on one of
`concurrency` worker threads (task.env_concurrency), and an environment whose
`step` (or `init`, `close`) is `async def` has its coroutine run on the
process's one event loop, so a thousand awaiting tools cost no threads while
they wait. An episode's calls still run one after another, in the order they
came: its environment object is never entered twice at once.

Timeouts: a call past task.env_timeout_seconds is answered as a timeout at once
and its episode dropped. Its thread is interrupted as SIGALRM interrupted the
one-at-a-time process (an exception raised in it at the next Python bytecode,
which an environment's `except Exception` cannot swallow); a thread blocked in C
never sees it, so it is written off and replaced. A process that has written off
more than `MAX_STUCK_PER_WORKER` threads a worker exits, and its parent starts a
fresh one (envs/process.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import inspect
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvHost, EnvTimeout, as_coroutine

MAX_STUCK_PER_WORKER = 4  # threads written off (calls that never returned), per worker, before the process gives up


class CallInterrupted(BaseException):
    """Raised inside a worker whose call ran past its timeout; a BaseException, so `except Exception` lets it by."""


def interrupt(thread_id: int) -> None:
    """Raise CallInterrupted in that thread at its next bytecode (CPython's own mechanism, as signals use)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(CallInterrupted))


@dataclass
class _Running:
    call: EnvCall
    started: float
    abandoned: bool = False


class EventLoopThread:
    """One asyncio loop on a thread of its own, for environments whose methods are coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="env-loop", daemon=True)
        self._thread.start()

    def wait(self, awaitable: Any, timeout_seconds: float) -> Any:
        """The awaitable's result, run on the loop; EnvTimeout (and the coroutine cancelled) past the timeout."""
        future = asyncio.run_coroutine_threadsafe(as_coroutine(awaitable), self.loop)
        try:
            return future.result(timeout_seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EnvTimeout(f"ran past {timeout_seconds:g}s (task.env_timeout_seconds)") from None


def awaiting_guard(loop: EventLoopThread, timeout_seconds: float) -> Callable[[Callable[[], Any]], Any]:
    """Runs a call; a coroutine it returns (an `async def` method) is awaited on the loop, under the timeout."""

    def guard(call: Callable[[], Any]) -> Any:
        value = call()
        return loop.wait(value, timeout_seconds) if inspect.isawaitable(value) else value

    return guard


class ConcurrentHost:
    """The environment process's calls, on worker threads, in order per episode; answers wait in `finished`."""

    def __init__(self, host: EnvHost, concurrency: int, timeout_seconds: float) -> None:
        self.host, self.concurrency, self.timeout_seconds = host, max(1, concurrency), timeout_seconds
        self.guard = awaiting_guard(EventLoopThread(), timeout_seconds)
        self.finished: queue.Queue[EnvAnswer] = queue.Queue()
        self._ready: queue.Queue[Optional[EnvCall]] = queue.Queue()
        self._waiting: dict[int, deque[EnvCall]] = {}  # by episode: calls behind the one it is running
        self._running: dict[int, _Running] = {}  # by worker thread id
        self._lock = threading.Lock()
        self.stuck = 0
        for _ in range(self.concurrency):
            self._add_worker()

    def submit(self, calls: list[EnvCall]) -> None:
        """Queue calls; each starts once its episode's previous call has answered and a worker is free."""
        with self._lock:
            for call in calls:
                behind = self._waiting.get(call.episode)
                if behind is not None:
                    behind.append(call)
                else:
                    self._waiting[call.episode] = deque()
                    self._ready.put(call)

    def expire(self, now: Optional[float] = None) -> bool:
        """Answer every call past its timeout as a timeout; False once too many threads are stuck to go on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [(t, r) for t, r in self._running.items()
                    if not r.abandoned and now - r.started > self.timeout_seconds]
            for thread_id, running in late:
                running.abandoned = True
                self.stuck += 1
                interrupt(thread_id)
        for _, running in late:
            self.host.live.pop(running.call.episode, None)
            self._done(EnvAnswer(running.call.episode, failure="timeout", seconds=now - running.started,
                                 detail=f"ran past {self.timeout_seconds:g}s (task.env_timeout_seconds)"))
            self._add_worker()  # the stuck one never comes back
        return self.stuck <= MAX_STUCK_PER_WORKER * self.concurrency

    def _add_worker(self) -> None:
        threading.Thread(target=self._work, name="env-worker", daemon=True).start()

    def _work(self) -> None:
        try:
            self._serve_calls()
        except CallInterrupted:  # written off by `expire`, which answered its call and started another worker
            with self._lock:
                self._running.pop(threading.get_ident(), None)
                self.stuck -= 1  # it came back after all

    def _serve_calls(self) -> None:
        me = threading.get_ident()
        while (call := self._ready.get()) is not None:
            running = _Running(call, time.monotonic())
            with self._lock:
                self._running[me] = running
            answer = self.host.answer(call, self.guard)
            with self._lock:
                del self._running[me]
                if running.abandoned:  # answered as a timeout already, and replaced: this thread is done
                    self.stuck -= 1
                    return
            self._done(answer)

    def _done(self, answer: EnvAnswer) -> None:
        """Hand the answer back, and start the episode's next call if one waits."""
        self.finished.put(answer)
        with self._lock:
            behind = self._waiting.get(answer.episode)
            if behind:
                self._ready.put(behind.popleft())
            else:
                self._waiting.pop(answer.episode, None)
