"""Tests for grpo_fleet.learner.door.verifier_thread: stopping takes nothing more, then the final checkpoint."""

from __future__ import annotations

import threading
import time

from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.verifier_thread import RolloutsVerifier
from grpo_fleet.protocol import messages as m


def test_close_starts_no_queued_submission_and_returns_after_the_one_in_hand():
    verifier = RolloutsVerifier()
    started, release = threading.Event(), threading.Event()
    taken: list[str] = []

    def job(name: str, *, slow: bool = False):
        def answer() -> Reply:
            if slow:
                started.set()
                release.wait(10)
            time.sleep(0.05)  # the take itself, after a (slow) reward
            taken.append(name)
            return Reply(m.Ack(lease_id=name, status="accepted"))
        return answer

    verifier.submit(b"a", job("in-hand", slow=True))
    assert started.wait(10)
    for name in ("queued-1", "queued-2"):
        verifier.submit(b"b", job(name))
    threading.Timer(0.3, release.set).start()  # the reward in hand answers a little after the stop began
    closed_at = time.monotonic()
    dropped = verifier.close()
    assert time.monotonic() - closed_at >= 0.25  # waited for the submission in hand
    assert taken == ["in-hand"] and dropped == 2  # the queued ones were never taken: the final save has it all
    time.sleep(0.2)
    assert taken == ["in-hand"]  # and nothing is taken after close returned
    assert [(identity, reply.message.lease_id) for identity, reply in verifier.answers()] == [(b"a", "in-hand")]


def test_close_with_nothing_submitted_returns_at_once():
    verifier = RolloutsVerifier()
    closed_at = time.monotonic()
    assert verifier.close() == 0
    assert time.monotonic() - closed_at < 1.0 and verifier.answers() == []
