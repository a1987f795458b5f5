"""The learner's door judges a peer before it decodes the peer's message (issue 29: "decoded before judged").

Driven through the door's transport held in memory (tests/memory_transport.py), on a real tiny learner."""

from __future__ import annotations

from typing import Callable

import msgpack
import pytest

import grpo_fleet.protocol.sockets as sockets
from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.door.dispatch import door_of
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
from grpo_fleet.protocol import PROTOCOL_VERSION, encode
from grpo_fleet.protocol import messages as m
from memory_transport import MemoryTransport


def test_a_banned_peers_message_is_refused_before_it_is_decoded(make: Callable[..., RunCoordinator],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    learner = make()
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring=None, verifier=None)
    learner.registry.record_violation(peer_key(b"pest", None), "malformed", ban_now=True)
    decoded: list[bytes] = []
    real_decode = sockets.decode

    def spy(buffer: memoryview, limits: object) -> object:
        decoded.append(bytes(buffer))
        return real_decode(buffer, limits)  # type: ignore[arg-type]

    monkeypatch.setattr(sockets, "decode", spy)
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Heartbeat", "body": {}}, use_bin_type=True)
    transport.deliver(b"pest", payload)
    transport.deliver(b"stranger", payload)  # the same bytes from a peer not banned: decoded, and answered
    door.pump(timeout_ms=0)
    assert decoded == [payload], "a banned peer's bytes were decoded"
    assert not transport.inbox  # the banned peer's message was taken off the transport all the same
    assert transport.replies_to(b"pest") == []
    [answer] = transport.replies_to(b"stranger")
    assert isinstance(answer, m.ErrorReply) and answer.reason == "not_registered"
    banned = learner.metrics.registry.get_sample_value("grpo_fleet_learner_protocol_errors_total", {"reason": "banned"})
    assert banned == 1


def test_rollouts_the_verifier_has_no_room_for_are_answered_busy_and_counted(
        make: Callable[..., RunCoordinator]) -> None:
    """Issue 29: the verifier's queue was unbounded; now one more is refused with a retryable reason."""
    learner = make()
    transport = MemoryTransport()
    verifier: RolloutsVerifier = RolloutsVerifier(max_queued=0)  # a verifier thread with no room left
    try:
        door = door_of(learner, transport, keyring=None, verifier=verifier)
        rollouts = m.Rollouts(lease_id="a" * 32, policy_version=0, groups=[],
                              unscored=[m.UnscoredGroup(group_id="g00000001", reward="r", error="timeout")])
        transport.deliver(b"actor", encode(rollouts))
        door.pump(timeout_ms=0)
    finally:
        verifier.close()
    [reply] = transport.replies_to(b"actor")
    assert isinstance(reply, m.ErrorReply) and reply.reason == m.BUSY
    busy = learner.metrics.registry.get_sample_value("grpo_fleet_learner_fair_share_refusals_total",
                                                     {"reason": "busy"})
    assert busy == 1
