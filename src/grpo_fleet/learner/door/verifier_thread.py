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
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

from grpo_fleet.learner.door.replies import Reply

Job = tuple[bytes, Callable[[], Reply]]  # who to answer, and how to work the answer out

# How long close() waits for the submission in hand; the actor resends what was not answered.
CLOSE_TIMEOUT_SECONDS = 30.0


class RolloutsVerifier:
    """A queue of received Rollouts, answered in order on one thread; their replies wait in `answers()`."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[Optional[Job]] = queue.Queue()
        self._outbox: queue.Queue[tuple[bytes, Reply]] = queue.Queue()
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
        while (job := self._inbox.get()) is not None:
            identity, answer = job
            self._outbox.put((identity, answer()))

    def close(self) -> None:
        """Answer what was submitted (the replies stay in `answers()`), then stop."""
        self._inbox.put(None)
        self._thread.join(timeout=CLOSE_TIMEOUT_SECONDS)
