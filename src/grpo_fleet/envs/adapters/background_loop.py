"""One asyncio event loop per process, in a daemon thread, for environments whose own code is async.

The host calls an environment's init and step from plain threads (the actor's
environment process, the learner's replay), and those may be inside an event loop
of their own. A private loop in its own thread runs every coroutine of this
process's episodes, so a rollout can wait there between turns, and a caller never
needs to own a loop. A call that runs past the host's timeout is interrupted in the
calling thread (SIGALRM or the parent's deadline), never in the loop's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, Optional, TypeVar

T = TypeVar("T")
WAKE_SECONDS = 0.05

_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None


def background_loop() -> asyncio.AbstractEventLoop:
    """This process's loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="grpo-fleet-env-loop", daemon=True).start()
        return _loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run the coroutine on the background loop and wait for its result (its exception is raised here).

    The wait wakes every WAKE_SECONDS, so an interruption the host raises in this thread (envs/pool.py raises
    one at the next bytecode when a call runs past its timeout) lands; the coroutine is then cancelled."""
    future = asyncio.run_coroutine_threadsafe(coroutine, background_loop())
    try:
        return wait(future)
    finally:
        future.cancel()  # a no-op once it is done


def wait(future: concurrent.futures.Future[T]) -> T:
    """The future's result, waited for in wakes of WAKE_SECONDS (so an interruption of this thread lands)."""
    while True:
        try:
            return future.result(timeout=WAKE_SECONDS)
        except concurrent.futures.TimeoutError:
            continue
