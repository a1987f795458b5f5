"""Rollouts answered on their own thread, so that a slow reward never holds the request loop.

The learner re-scores every submitted group with its own rewards
(learner/verify/actor_checks.py): one round trip to the reward process per
submission, as slow as the task's reward (a sympy check, a sandboxed test run,
a judge). On the I/O thread, under the lock, every other actor's request waited
that long. Here the loop hands each Rollouts to one verifier thread, which
scores it outside the lock, takes it (`RequestHandlers.handle_rollouts`, learner/run/handlers.py), and leaves the
answer in an outbox the loop sends from: the Ack goes out once the verdict is
in. No socket is touched on this thread. One thread keeps the reward process
to one caller.

Bounded and fair: at most `server.verify_queue` submissions wait, and at most
PER_KEY_QUEUED of one actor key (an honest actor has one unanswered submission,
two across a reconnect); one more is answered `busy`, counted, and the actor
resends it shortly. The waiting ones are taken in turn, one per actor key, so an
actor whose completions run the learner's reward to its timeout delays another
actor's answer by at most the submission in hand plus one of its own queued
ones, not by its whole queue; and each such timeout is charged to it
(`reward_timeout`, learner/door/intake.py) until it is banned.

Stopping takes nothing more: `close` drops the submissions not started (unanswered:
their actors resend them, to the resumed learner) and waits for the one in hand,
whose scoring the reward's own timeout bounds, and whose environment replay it
interrupts (the replay's child process is killed: its group is unverifiable and
re-queued); so the final checkpoint, written after it, holds every group that
was taken.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from typing import Callable, Generic, Optional, TypeVar

Reply = TypeVar("Reply")  # the door's answer (learner/door/replies.py); this floor, below the door, names no type of it
Job = tuple[bytes, Callable[[], Reply]]  # who to answer, and how to work the answer out

log = logging.getLogger("grpo_fleet.learner")

# Submissions of one actor key that may wait at once.
PER_KEY_QUEUED = 4


class RolloutsVerifier(Generic[Reply]):
    """Received Rollouts, answered on one thread, one actor key at a time in turn; replies wait in `answers()`."""

    def __init__(self, max_queued: int = 64, per_key: int = PER_KEY_QUEUED,
                 interrupt: Optional[Callable[[], None]] = None) -> None:
        self.max_queued, self.per_key = max_queued, per_key
        self.interrupt = interrupt  # ends the work in hand early when stopping (an environment replay: its child)
        self._waiting: OrderedDict[str, deque[Job[Reply]]] = OrderedDict()  # by actor key; the next to serve first
        self._queued = 0
        self._ready = threading.Condition()
        self._closing = False  # set: start no other job
        self._outbox: queue.Queue[tuple[bytes, Reply]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="verify", daemon=True)
        self._thread.start()

    def submit(self, identity: bytes, key: str, answer: Callable[[], Reply]) -> bool:
        """Queue a submission from actor key `key`; False (nothing queued) when the queue, or the key's share of
        it, is full."""
        with self._ready:
            mine = self._waiting.get(key)
            if self._closing or self._queued >= self.max_queued or (mine is not None and len(mine) >= self.per_key):
                return False
            self._waiting.setdefault(key, deque()).append((identity, answer))
            self._queued += 1
            self._ready.notify()
            return True

    def queued(self) -> int:
        with self._ready:
            return self._queued

    def answers(self) -> list[tuple[bytes, Reply]]:
        """Every reply ready now, as (identity, reply), oldest first; never blocks."""
        ready = []
        while True:
            try:
                ready.append(self._outbox.get_nowait())
            except queue.Empty:
                return ready

    def _next(self) -> Optional[Job[Reply]]:
        """The oldest submission of the key whose turn it is (that key then goes last); None once closing."""
        with self._ready:
            while not self._closing and not self._queued:
                self._ready.wait()
            if self._closing:
                return None
            key, jobs = self._waiting.popitem(last=False)
            job = jobs.popleft()
            self._queued -= 1
            if jobs:
                self._waiting[key] = jobs
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            identity, answer = job
            self._outbox.put((identity, answer()))

    def close(self) -> int:
        """Start no other submission, answer the one in hand (its reply stays in `answers()`), then stop.

        Returns how many submissions were dropped unanswered (their actors resend them)."""
        with self._ready:
            self._closing = True
            dropped, self._queued = self._queued, 0
            self._waiting.clear()
            self._ready.notify_all()  # wakes the thread if it waits for a job
        if self._thread.is_alive():
            log.info("stopping: waiting for the Rollouts being verified (its reward's timeout bounds the wait)")
            if self.interrupt is not None:  # a replay in flight ends now: its group unverifiable, not charged
                self.interrupt()
        self._thread.join()
        if dropped:
            log.info("stopping: %d Rollouts not verified yet were dropped unanswered; their actors resend them", dropped)
        return dropped
