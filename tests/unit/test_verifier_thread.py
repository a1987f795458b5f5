"""Tests for grpo_fleet.learner.verify.verifier_thread: stopping takes nothing more, then the final checkpoint."""

from __future__ import annotations

import threading
import time

from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
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

    verifier.submit(b"a", "key-a", job("in-hand", slow=True))
    assert started.wait(10)
    for name in ("queued-1", "queued-2"):
        verifier.submit(b"b", "key-b", job(name))
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


def test_close_interrupts_the_work_in_hand_instead_of_waiting_it_out():
    """A replay hanging on an actor's turns (issue 39, item 1): `interrupt` (the replay's child killed) ends it."""
    release = threading.Event()
    verifier = RolloutsVerifier(interrupt=release.set)
    started = threading.Event()

    def hung() -> Reply:
        started.set()
        release.wait(60)  # until interrupted
        return Reply(m.Ack(lease_id="hung", status="stale"))

    verifier.submit(b"a", "key-a", hung)
    assert started.wait(10)
    closed_at = time.monotonic()
    verifier.close()
    assert time.monotonic() - closed_at < 5 and release.is_set()
    assert [reply.message.lease_id for _, reply in verifier.answers()] == ["hung"]  # answered, as unverifiable


def _held_verifier(**bounds: int) -> tuple[RolloutsVerifier, threading.Event, threading.Event, list[str]]:
    """A verifier whose first job holds the thread until `release` is set; `order` lists the jobs as answered."""
    verifier = RolloutsVerifier(**bounds)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> Reply:
        started.set()
        release.wait(30)
        order.append("slow-1")
        return Reply(m.Ack(lease_id="slow-1", status="accepted"))

    assert verifier.submit(b"slow", "slow-key", hold)
    assert started.wait(30)
    return verifier, started, release, order


def _job(name: str, order: list[str]):
    def answer() -> Reply:
        order.append(name)
        return Reply(m.Ack(lease_id=name, status="accepted"))
    return answer


def test_a_slow_actors_queue_does_not_hold_another_actors_answer_behind_all_of_it():
    """Issue 29: one actor whose rewards time out held every honest Ack behind its whole queue."""
    verifier, _, release, order = _held_verifier(max_queued=64, per_key=4)
    for name in ("slow-2", "slow-3", "slow-4"):
        assert verifier.submit(b"slow", "slow-key", _job(name, order))
    assert verifier.submit(b"honest", "honest-key", _job("honest-1", order))
    release.set()
    deadline = time.monotonic() + 30
    while len(order) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["slow-1", "slow-2", "honest-1", "slow-3", "slow-4"]
    verifier.close()


def test_the_queue_is_bounded_in_all_and_per_actor_key():
    verifier, _, release, order = _held_verifier(max_queued=3, per_key=2)
    assert verifier.submit(b"slow", "slow-key", _job("slow-2", order))
    assert verifier.submit(b"slow", "slow-key", _job("slow-3", order))
    assert verifier.submit(b"slow", "slow-key", _job("slow-4", order)) is False, "beyond the key's share"
    assert verifier.submit(b"other", "other-key", _job("other-1", order))
    assert verifier.submit(b"third", "third-key", _job("third-1", order)) is False, "beyond the whole queue"
    assert verifier.queued() == 3
    release.set()
    assert verifier.close() <= 3
