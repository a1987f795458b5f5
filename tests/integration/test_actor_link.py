"""The actor's link to a learner that binds late, over real ZeroMQ on 127.0.0.1."""

from __future__ import annotations

from typing import Iterator

import pytest
import zmq

from grpo_fleet.actor.link import LearnerLink, LearnerUnavailable
from grpo_fleet.config import ActorConfig
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.endpoints import free_port
from grpo_fleet.protocol.sockets import decode_routed, make_context, recv_routed_frames, router_socket, send_message

DIGEST = "0" * 64


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = make_context()
    yield context
    context.destroy(linger=0)


def _welcome(actor_id: str) -> m.Welcome:
    return m.Welcome(run_id="late-run", actor_id=actor_id, model=m.ModelRef(path="tiny", digest=DIGEST),
                     generation=m.GenerationParams(group_size=2, max_tokens=4, temperature=1.0, top_p=1.0),
                     reward=m.RewardSpec(names=["r"], weights=[1.0]), policy_version=0, heartbeat_seconds=2.0,
                     vocab_size=9)


def test_an_actor_backing_off_takes_the_welcome_to_its_last_hello(ctx: zmq.Context) -> None:
    # A learner that binds while the actor backs off gets the queued Hello and registers the actor. The actor
    # once slept through that Welcome, missed a short resumed run, Shutdown included, and dialled on for good.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    answers: list[object] = []
    link = LearnerLink(ActorConfig(connect=endpoint, actor_id="late", request_timeout=0.5), "late",
                       on_answer=answers.append, on_notice=answers.append)
    try:
        with pytest.raises(LearnerUnavailable, match="no reply to Hello"):
            link.open(m.Hello(actor_id="late", host="h", backend="cpu", versions={}))  # nobody listens yet
        router = router_socket(ctx, endpoint, max_message_bytes=1 << 20)
        try:
            assert router.poll(10_000), "the queued Hello never reached the learner"
            hello = decode_routed(recv_routed_frames(router))
            assert isinstance(hello.message, m.Hello) and hello.message.actor_id == "late"
            # An answer belonging to the session that ended comes first; it is dropped, not booked.
            send_message(router, m.Ack(lease_id="old", status="accepted"), identity=hello.identity)
            send_message(router, _welcome("late"), identity=hello.identity)
            welcome = link.await_late_welcome(10.0, give_up=lambda: False)
        finally:
            router.close(linger=0)
    finally:
        link.shut()
    assert welcome is not None and welcome.run_id == "late-run"
    assert answers == []


def test_backing_off_ends_early_when_the_actor_is_asked_to_stop() -> None:
    link = LearnerLink(ActorConfig(connect=f"tcp://127.0.0.1:{free_port()}", request_timeout=0.2), "quits",
                       on_answer=print, on_notice=print)
    try:
        with pytest.raises(LearnerUnavailable):
            link.open(m.Hello(actor_id="quits", host="h", backend="cpu", versions={}))
        asked = iter([False, True])
        assert link.await_late_welcome(600.0, give_up=lambda: next(asked, True)) is None
    finally:
        link.shut()
