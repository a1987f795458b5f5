"""The learner's loop judges a peer before it decodes the peer's message (issue 29: "decoded before judged")."""

from __future__ import annotations

import types

import msgpack
import zmq

import grpo_fleet.protocol.sockets as sockets
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.answers import Answers
from grpo_fleet.learner.door.doorman import Doorman
from grpo_fleet.learner.door.server import LearnerServer
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import DEFAULT_LIMITS, PROTOCOL_VERSION, decode, encode
from grpo_fleet.protocol import messages as m


class _Frame:
    """What pyzmq's Frame offers the loop: bytes, a buffer and the connection's metadata."""

    def __init__(self, data: bytes) -> None:
        self.bytes, self.buffer = data, memoryview(data)

    def get(self, key: str) -> str:
        return {"Peer-Address": "10.0.0.9"}[key]


class _Router:
    """One waiting [identity, payload] message, then nothing."""

    def __init__(self, identity: bytes, payload: bytes) -> None:
        self.waiting = [[_Frame(identity), _Frame(payload)]]

    def poll(self, timeout_ms: int, flags: int = 0) -> int:
        return 1 if self.waiting else 0

    def recv_multipart(self, copy: bool = True) -> list[_Frame]:
        return self.waiting.pop(0)


def _server_with(router: _Router, registry: Registry) -> LearnerServer:
    """The loop's state without its sockets: a fake router, a Doorman without CURVE, no verifier."""
    cfg = RunConfig()
    desk = types.SimpleNamespace(cfg=cfg, metrics=registry.metrics, registry=registry)
    server = object.__new__(LearnerServer)
    server.router, server.limits, server.verifier = router, DEFAULT_LIMITS, None
    server.learner = desk
    server.answers = Answers(desk)  # type: ignore[arg-type]
    server.door = Doorman(None, cfg, desk)  # type: ignore[arg-type]  # no keys_dir: it opens nothing
    return server


def test_a_banned_peers_message_is_refused_before_it_is_decoded(monkeypatch):
    registry = Registry(RunConfig().server, learner_metrics())
    identity = b"pest"
    registry.record_violation(peer_key(identity, None), "malformed", ban_now=True)
    decoded: list[bytes] = []
    real_decode = sockets.decode

    def spy(buffer, limits):
        decoded.append(bytes(buffer))
        return real_decode(buffer, limits)

    monkeypatch.setattr(sockets, "decode", spy)
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Heartbeat", "body": {}}, use_bin_type=True)
    server = _server_with(_Router(identity, payload), registry)
    server._pump(timeout_ms=0)
    assert decoded == [], "a banned peer's bytes were decoded"
    assert server.router.waiting == []  # the message was taken off the socket all the same
    banned = registry.metrics.registry.get_sample_value("grpo_fleet_learner_protocol_errors_total", {"reason": "banned"})
    assert banned == 1


class _FullVerifier:
    """A verifier with no room: every submission is refused."""

    def submit(self, identity: bytes, key: str, answer) -> bool:
        return False

    def answers(self) -> list:
        return []


class _SendingRouter(_Router):
    type = zmq.ROUTER

    def __init__(self, identity: bytes, payload: bytes) -> None:
        super().__init__(identity, payload)
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames, flags: int = 0, copy: bool = True) -> None:
        self.sent.append([bytes(frame) for frame in frames])


def test_rollouts_the_verifier_has_no_room_for_are_answered_busy_and_counted():
    """Issue 29: the verifier's queue was unbounded; now one more is refused with a retryable reason."""
    registry = Registry(RunConfig().server, learner_metrics())
    rollouts = m.Rollouts(lease_id="a" * 32, policy_version=0, groups=[],
                          unscored=[m.UnscoredGroup(group_id="g00000001", reward="r", error="timeout")])
    router = _SendingRouter(b"actor", encode(rollouts))
    server = _server_with(router, registry)
    server.verifier = _FullVerifier()  # type: ignore[assignment]
    server._pump(timeout_ms=0)
    [(identity, payload)] = router.sent
    reply = decode(payload)
    assert identity == b"actor" and isinstance(reply, m.ErrorReply) and reply.reason == m.BUSY
    busy = registry.metrics.registry.get_sample_value("grpo_fleet_learner_fair_share_refusals_total",
                                                      {"reason": "busy"})
    assert busy == 1
