"""What an actor holds in flight: prefetched lease, unacknowledged submission, Ack pairing, drain. No sockets."""

from __future__ import annotations

import signal

import numpy as np

from grpo_fleet.actor.link import LearnerUnavailable
from grpo_fleet.actor.pipeline import InFlight
from grpo_fleet.actor.worker import ActorWorker
from grpo_fleet.config import ActorConfig, MetricsConfig
from grpo_fleet.protocol import messages as m

LEASE_ID = "0123456789abcdef0123456789abcdef"


def _lease(lease_id: str = LEASE_ID, prompts: int = 1) -> m.Lease:
    item = m.PromptItem(group_id="g00000001", prompt_index=0, prompt_tokens=m.Tensor.from_numpy(np.array([1, 2], np.int32)),
                        fields={})
    return m.Lease(lease_id=lease_id, deadline_seconds=10.0, policy_version=0, prompts=[item] * prompts)


def _rollouts(lease_id: str = LEASE_ID) -> m.Rollouts:
    completion = m.Completion(tokens=m.Tensor.from_numpy(np.array([3], np.int32)),
                              logprobs=m.Tensor.from_numpy(np.array([-0.5], np.float32)), reward=1.0, finish_reason="stop")
    return m.Rollouts(lease_id=lease_id, policy_version=0, groups=[m.GroupResult(group_id="g00000001", completions=[completion])])


def test_a_booked_lease_is_handed_over_once() -> None:
    inflight = InFlight(lease_requested=True)
    lease = _lease()
    inflight.book_lease(lease)
    assert not inflight.lease_requested and not inflight.drained
    assert inflight.take_lease() is lease and inflight.take_lease() is None
    assert inflight.drained


def test_an_ack_answers_the_submission_in_flight() -> None:
    inflight = InFlight(submitted=_rollouts())
    answered = inflight.pair_ack(m.Ack(lease_id=LEASE_ID, status="accepted"))
    assert answered is not None and answered.lease_id == LEASE_ID
    assert inflight.submitted is None and inflight.drained


def test_an_ack_with_nothing_submitted_pairs_with_nothing() -> None:
    assert InFlight().pair_ack(m.Ack(lease_id=LEASE_ID, status="duplicate")) is None


def test_an_ack_for_another_lease_leaves_the_submission_awaiting_its_own() -> None:
    """A late answer to a submission settled over an older connection must not settle the current one."""
    inflight = InFlight(submitted=_rollouts())
    assert inflight.pair_ack(m.Ack(lease_id="fedcba9876543210fedcba9876543210", status="accepted")) is None
    assert inflight.submitted is not None and inflight.submitted.lease_id == LEASE_ID


def test_hello_names_the_leases_still_held_after_a_reconnect() -> None:
    other = "fedcba9876543210fedcba9876543210"
    inflight = InFlight(submitted=_rollouts(), next_lease=_lease(other), lease_requested=True)
    assert inflight.holding() == [LEASE_ID, other]
    inflight.new_connection()  # the old socket's answers are gone; the work is kept
    assert not inflight.lease_requested and inflight.holding() == [LEASE_ID, other]
    assert InFlight(next_lease=_lease("", prompts=0)).holding() == []  # a no-work lease holds nothing


def test_another_run_forgets_the_work_in_hand() -> None:
    inflight = InFlight(submitted=_rollouts(), next_lease=_lease())
    inflight.forget()
    assert inflight.drained and inflight.holding() == []


def _run_keeping_pytests_signal_handlers(worker: ActorWorker) -> None:
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        worker.run()
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])


def test_a_first_stop_signal_gives_up_on_a_learner_that_is_gone():
    """Signalled once while the learner is away, the actor waits one request timeout for it, then exits: a
    Ctrl-C to the whole fleet stops the learner too, and the leases come back to the resumed learner."""
    worker = ActorWorker(ActorConfig(metrics=MetricsConfig(port=0)))
    sessions: list[str] = []

    def session(welcome: object = None) -> None:
        assert not sessions, "reconnected after a stop signal, to a learner that may never come back"
        sessions.append("session")
        worker.inflight.submitted = _rollouts()  # generated, sent, never acknowledged
        worker.request_stop()
        raise LearnerUnavailable("no reply to Rollouts")

    worker._session = session  # type: ignore[method-assign]
    _run_keeping_pytests_signal_handlers(worker)
    assert sessions == ["session"] and worker.inflight.submitted is not None


def test_a_busy_answer_resends_the_submission_without_reconnecting(monkeypatch):
    """Issue 29: a learner whose verifier queue is full answers `busy`; the actor resends, it does not Hello again
    (which would put it back on probation)."""
    import grpo_fleet.actor.worker as worker_module

    monkeypatch.setattr(worker_module, "BUSY_RESEND_SECONDS", 0.0)
    worker = ActorWorker(ActorConfig(metrics=MetricsConfig(port=0)))
    sent: list[object] = []
    monkeypatch.setattr(worker.link, "send", sent.append)
    worker.inflight.submitted = submitted = _rollouts()
    try:
        worker.link._route(m.ErrorReply(reason=m.BUSY, detail="queue full"))  # the learner's answer, as read
    finally:
        worker.link.shut()
    assert sent == [submitted] and worker.inflight.submitted is submitted  # still awaiting its Ack
    assert worker.metrics.registry.get_sample_value("grpo_fleet_actor_submit_retries_total") == 1
