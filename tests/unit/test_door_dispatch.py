"""The learner's door on bytes a peer would send: decoding, dispatch to the run, replies and notices.

Driven through the door's transport held in memory (tests/memory_transport.py), on a real tiny learner: no
socket, and the door built as the server builds it (learner/door/dispatch.py: door_of)."""

from __future__ import annotations

import time
from typing import Callable

from test_learner_core import ACTOR_A, lease, rollouts_for

from grpo_fleet.learner.door.dispatch import door_of
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
from grpo_fleet.protocol import encode
from grpo_fleet.protocol import messages as m
from memory_transport import MemoryTransport

HELLO = m.Hello(actor_id="actor-a", host="testhost", backend="cpu", versions={})


def _violations(learner: RunCoordinator, reason: str) -> float:
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_protocol_errors_total", {"reason": reason}) or 0


def test_a_hello_is_decoded_dispatched_and_answered_welcome(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring=None, verifier=None)
    transport.deliver(ACTOR_A, encode(HELLO))
    door.pump(timeout_ms=0)
    [welcome] = transport.replies_to(ACTOR_A)
    assert isinstance(welcome, m.Welcome) and welcome.run_id == learner.state.run_id
    assert ACTOR_A in learner.registry.actors


def test_bytes_that_do_not_decode_are_answered_with_the_reason_and_counted(
        make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring=None, verifier=None)
    transport.deliver(b"garbler", b"\xc1 not msgpack")
    transport.deliver(b"framer", encode(HELLO), b"one frame too many")
    door.pump(timeout_ms=0)
    [garbled] = transport.replies_to(b"garbler")
    [framed] = transport.replies_to(b"framer")
    assert isinstance(garbled, m.ErrorReply) and garbled.reason == "malformed"
    assert isinstance(framed, m.ErrorReply) and framed.reason == "bad_frames"
    assert _violations(learner, "malformed") == 1 and _violations(learner, "bad_frames") == 1
    assert b"framer" not in learner.registry.actors  # its Hello was never taken


def test_a_weight_chunk_goes_out_with_its_raw_bytes_and_is_counted(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring=None, verifier=None)
    transport.deliver(ACTOR_A, encode(HELLO))
    transport.deliver(ACTOR_A, encode(m.GetWeights(version=0, offset=0, length=100)))
    door.pump(timeout_ms=0)
    _, _, raw = transport.sent[-1]
    [_, chunk] = transport.replies_to(ACTOR_A)
    assert isinstance(chunk, m.WeightsChunk) and chunk.length == 100
    assert raw == bytes(learner.snapshots.current.blob[:100])
    served = learner.metrics.registry.get_sample_value("grpo_fleet_learner_weight_sent_bytes_total")
    assert served == 100


def test_rollouts_are_answered_from_the_verifier_thread_by_a_later_pump(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    transport = MemoryTransport()
    verifier: RolloutsVerifier = RolloutsVerifier()
    door = door_of(learner, transport, keyring=None, verifier=verifier)
    try:
        transport.deliver(ACTOR_A, encode(HELLO))
        door.pump(timeout_ms=0)
        granted = lease(learner)
        transport.deliver(ACTOR_A, encode(rollouts_for(granted)))
        deadline = time.monotonic() + 30
        while len(transport.replies_to(ACTOR_A)) < 2 and time.monotonic() < deadline:
            door.pump(timeout_ms=10)
    finally:
        door.stop_verifier()
    [_, ack] = transport.replies_to(ACTOR_A)
    assert isinstance(ack, m.Ack) and ack.lease_id == granted.lease_id and ack.status == "accepted"
    assert len(learner.state.buffer) == len(granted.prompts)


def test_at_the_end_every_actor_hears_shutdown_on_the_pub_and_as_its_reply(
        make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring=None, verifier=None)
    transport.deliver(ACTOR_A, encode(HELLO))
    door.pump(timeout_ms=0)
    transport.deliver(ACTOR_A, encode(m.Heartbeat(actor_id="actor-a")))
    started = time.monotonic()
    door.say_goodbye(grace_seconds=30)
    assert time.monotonic() - started < 10, "the door waited for an actor that had heard it"
    assert isinstance(transport.replies_to(ACTOR_A)[-1], m.Shutdown)
    assert transport.published and door.answers.unheard() == set()
