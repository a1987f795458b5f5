"""Rollouts answered on their own thread, so that a slow reward never holds the request loop.

The learner re-scores every submitted group with its own rewards
(learner/door/actor_checks.py): one round trip to the reward process per
submission, as slow as the task's reward (a sympy check, a sandboxed test run,
a judge). On the I/O thread, under the lock, every other actor's request waited
that long. Here the loop hands each Rollouts to one verifier thread, which
scores it outside the lock, takes it (`Learner.handle_rollouts`), and leaves the
answer in an outbox the loop sends from: the Ack goes out once the verdict is
in. No socket is touched on this thread. One thread keeps submissions in the
order they came, and the reward process to one caller.

Stopping takes nothing more: `close` drops the submissions not started (unanswered:
their actors resend them, to the resumed learner) and waits for the one in hand,
whose scoring the reward's own timeout bounds; so the final checkpoint, written
after it, holds every group that was taken.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from grpo_fleet.learner.door.replies import Reply

Job = tuple[bytes, Callable[[], Reply]]  # who to answer, and how to work the answer out

log = logging.getLogger("grpo_fleet.learner")


class RolloutsVerifier:
    """A queue of received Rollouts, answered in order on one thread; their replies wait in `answers()`."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[Optional[Job]] = queue.Queue()
        self._outbox: queue.Queue[tuple[bytes, Reply]] = queue.Queue()
        self._closing = threading.Event()  # set: start no other job
        self._thread = threading.Thread(target=self._run, name="verify", daemon=True)
        self._thread.start()

    def submit(self, identity: bytes, answer: Callable[[], Reply]) -> None:
        self._inbox.put((identity, answer))

    def answers(self) -> list[tuple[bytes, Reply]]:
        """Every reply ready now, as (identity, reply), oldest first; never blocks."""
        ready = []
        while True:
            try:
                ready.append(self._outbox.get_nowait())
            except queue.Empty:
                return ready

    def _run(self) -> None:
        while (job := self._inbox.get()) is not None and not self._closing.is_set():
            identity, answer = job
            self._outbox.put((identity, answer()))

    def close(self) -> int:
        """Start no other submission, answer the one in hand (its reply stays in `answers()`), then stop.

        Returns how many submissions were dropped unanswered (their actors resend them)."""
        self._closing.set()
        dropped = 0
        while True:
            try:
                dropped += self._inbox.get_nowait() is not None
            except queue.Empty:
                break
        self._inbox.put(None)  # wakes the thread if it waits for a job
        if self._thread.is_alive():
            log.info("stopping: waiting for the Rollouts being verified (its reward's timeout bounds the wait)")
        self._thread.join()
        if dropped:
            log.info("stopping: %d Rollouts not verified yet were dropped unanswered; their actors resend them", dropped)
        return dropped
