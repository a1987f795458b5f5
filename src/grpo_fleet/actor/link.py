"""The actor's link to the learner: one pipelined DEALER for requests, a SUB for notices.

All of the actor's socket work happens here, through `protocol.sockets`.
Requests are pipelined on the one DEALER, so the network never idles the model:
an answer that is not the one being waited for (the prefetched Lease, a
submission's Ack) is handed to `on_answer` as it arrives. The link never decides
what an answer means; it only raises `LearnerUnavailable` (register again, with
backoff) or `StopActor`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Optional, TypeVar, Union
from urllib.parse import urlparse

from pydantic import BaseModel

from grpo_fleet.actor.admission import ActorRefused
from grpo_fleet.actor.notices import Notice, Notices, StopActor
from grpo_fleet.config import ActorConfig
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import Keypair, client_curve
from grpo_fleet.protocol.codec import Limits, ProtocolError
from grpo_fleet.protocol.endpoints import is_wildcard_host
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.sockets import dealer_socket, make_context, recv_message, recv_with_raw, send_message, sub_socket
from grpo_fleet.protocol.weights import VersionGone

log = logging.getLogger("grpo_fleet.actor")
Reply = TypeVar("Reply")
# How long one receive blocks, so notices and the deadline are looked at between answers.
POLL_SECONDS = 0.5
# After a Shutdown heard on PUB only: how long to wait for the learner's direct answer to our last word.
GOODBYE_SECONDS = 1.0
Answer = Union[m.Lease, m.Ack, m.ErrorReply]  # ErrorReply: BUSY only, a submission to resend


class LearnerUnavailable(Exception):
    """No answer within the timeout, or the learner forgot us: register again."""


def load_curve(cfg: ActorConfig) -> Optional[tuple[Keypair, bytes]]:
    """(own keypair, learner public key) when CURVE is configured; a bad key setup refuses to run."""
    try:
        return client_curve(cfg.key_file, cfg.learner_key_file)
    except ValueError as exc:
        raise ActorRefused(str(exc)) from None


def routing_id(actor_id: str, curve: Optional[tuple[Keypair, bytes]]) -> bytes:
    """The routing id the learner's ROUTER knows this actor by: its actor id, and with CURVE a tag only its secret
    key can make.

    The ROUTER hands a routing id over to whoever connects with it last (so a
    restarted actor gets its own back). Actor ids are public (`status`, /sd, metric
    labels); with CURVE the routing id travels encrypted in the handshake, so with
    the tag no other key can take this actor's connection over. It stays the same
    across restarts with the same key.
    """
    if curve is None or curve[0].secret is None:
        return actor_id.encode()
    tag = hashlib.blake2b(actor_id.encode(), key=curve[0].secret, digest_size=8).hexdigest()
    return f"{actor_id}.{tag}".encode()


def notice_address(pub_address: Optional[str], connect: str) -> str:
    """Where to subscribe: a learner bound to a wildcard advertises it; dial the host we reached it on."""
    parsed = urlparse(pub_address or "")
    host = parsed.hostname
    if is_wildcard_host(host):
        host = urlparse(connect).hostname
    return f"tcp://{host}:{parsed.port}"


class LearnerLink:
    """Requests, pipelined answers, weight chunks and notices between one actor and its learner."""

    def __init__(
        self, cfg: ActorConfig, actor_id: str, on_answer: Callable[[Answer], None], on_notice: Callable[[Notice], None]
    ) -> None:
        self.connect, self.actor_id, self.timeout = cfg.connect, actor_id, cfg.request_timeout
        self.curve = load_curve(cfg)
        self._on_answer = on_answer
        # The learner is trusted more than actors are: allow large weight blobs.
        self.limits = Limits(max_message_bytes=1 << 30, max_bin_len=1 << 30)
        self.ctx = make_context()
        # zmq sockets from protocol.sockets (zmq itself stays out of this module); None while closed.
        self._dealer: Any = None
        self.notices = Notices(self.limits, on_notice)
        self._last_heartbeat = 0.0

    def open(self, hello: m.Hello, give_up: Callable[[], bool] = lambda: False) -> m.Welcome:
        """A fresh request socket, registered with the learner (unless `give_up()` first, see `request`)."""
        self.close()
        self._dealer = dealer_socket(
            self.ctx, self.connect, identity=routing_id(self.actor_id, self.curve),
            max_message_bytes=self.limits.max_message_bytes, curve=self.curve,
        )
        return self.request(hello, m.Welcome, give_up)

    def listen(self, pub_address: Optional[str]) -> None:
        """Subscribe to the learner's notices (PolicyUpdated, Heartbeat, Shutdown)."""
        self.notices.attach(sub_socket(self.ctx, notice_address(pub_address, self.connect), curve=self.curve))

    def close(self) -> None:
        """Close both sockets; answers still on their way are lost."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._dealer = None
        self.notices.close()

    def shut(self) -> None:
        """Close the sockets and the context: the link is done."""
        self.close()
        self.ctx.term()

    def send(self, msg: BaseModel) -> None:
        """Send without waiting: its answer comes to `on_answer`, or to whoever awaits it."""
        send_message(self._dealer, msg)

    def request(self, msg: BaseModel, expected: type[Reply], give_up: Callable[[], bool] = lambda: False) -> Reply:
        """Send and wait for a reply of the expected type; other answers are routed as they come.

        `give_up()` is asked between polls: true means stop waiting (StopActor).
        """
        self.send(msg)
        deadline = time.monotonic() + self.timeout
        while not isinstance(reply := self._next_reply(deadline, type(msg).__name__), expected):
            if give_up():
                raise StopActor(f"asked to stop while waiting for the learner's answer to {type(msg).__name__}")
            self._route(reply)
        return reply

    def await_late_welcome(self, seconds: float, give_up: Callable[[], bool]) -> Optional[m.Welcome]:
        """Backing off after a request went unanswered: the Welcome to our last Hello, if it comes within `seconds`.

        The socket stays open meanwhile, and libzmq delivers a queued Hello as soon as a learner binds. The
        learner registers us then; had we slept blind, its Welcome would be dropped with the socket, we
        would miss a short run's whole life, Shutdown included, and then dial a learner that is gone. Any
        other answer belongs to the session that ended and is dropped.
        """
        deadline = time.monotonic() + seconds
        while not give_up() and (remaining := deadline - time.monotonic()) > 0:
            if self._dealer is None:  # no socket to read (it could not be made): the backoff is a plain wait
                time.sleep(min(remaining, 0.05))
                continue
            try:
                reply = recv_message(self._dealer, timeout_s=min(remaining, POLL_SECONDS), limits=self.limits)
            except ProtocolError:
                continue
            if isinstance(reply, m.Welcome):
                return reply
        return None

    def await_answers(self, settled: Callable[[], bool]) -> None:
        """Read answers until `settled()`; no answer within the request timeout means the learner is gone."""
        deadline = time.monotonic() + self.timeout
        while not settled():
            reply = self._next_reply(deadline, "a pipelined request")
            if reply is not None:
                self._route(reply)

    def take_answers(self) -> None:
        """Route every answer already here, without waiting: between decoding steps, the batch never waits on us."""
        while self._dealer is not None:
            try:
                reply = recv_message(self._dealer, timeout_s=0, limits=self.limits)
            except ProtocolError as exc:
                log.warning("bad reply from learner: %s", shown(exc))
                continue
            if reply is None:
                return
            self._route(reply)

    def await_chunk(self, offset: int) -> tuple[m.WeightsChunk, memoryview]:
        """The weight chunk starting at `offset`; leftovers of an abandoned transfer are skipped."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                received = recv_with_raw(self._dealer, timeout_s=POLL_SECONDS, limits=self.limits)
            except ProtocolError as exc:
                log.warning("bad reply from learner: %s", shown(exc))
                continue
            if received is None:
                continue
            msg, raw = received
            if isinstance(msg, m.WeightsChunk):
                if raw is not None and msg.offset == offset:
                    return msg, raw
                continue
            if isinstance(msg, m.WeightsGone):
                raise VersionGone(msg.requested, msg.current)
            self._route(msg)
        raise LearnerUnavailable("no weight chunk")

    def heartbeat(self, policy_version: int, every_seconds: float) -> None:
        """Tell the learner we are alive, at most once per `every_seconds` (called between decoding steps)."""
        now = time.monotonic()
        if now - self._last_heartbeat >= every_seconds:
            self._last_heartbeat = now
            self.send(m.Heartbeat(actor_id=self.actor_id, policy_version=max(policy_version, 0), sent_at=time.time()))

    def answer_shutdown(self, policy_version: int) -> None:
        """Heard Shutdown on PUB only: say one last word, so the learner, which lingers until every actor has been
        told directly (PUB can miss a reconnecting subscriber), need not wait out its grace for us. Its answer is
        Shutdown; waiting for it (bounded) keeps our word from being dropped when the socket closes."""
        if self._dealer is None:
            return
        self.send(m.Heartbeat(actor_id=self.actor_id, policy_version=max(policy_version, 0), sent_at=time.time()))
        deadline = time.monotonic() + GOODBYE_SECONDS
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if isinstance(recv_message(self._dealer, timeout_s=remaining, limits=self.limits), m.Shutdown):
                    return
            except ProtocolError:
                continue

    def _next_reply(self, deadline: float, what: str) -> Optional[object]:
        """The learner's next answer, or None if none came within POLL_SECONDS; past `deadline` it is gone."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LearnerUnavailable(f"no reply to {what}")
        try:
            return recv_message(self._dealer, timeout_s=min(remaining, POLL_SECONDS), limits=self.limits)
        except ProtocolError as exc:
            if exc.reason == "bad_version":
                raise ActorRefused(f"the learner's reply: {exc.message}") from None
            log.warning("bad reply from learner: %s", shown(exc))
            return None

    def _route(self, reply: Optional[object]) -> None:
        """Anything but the awaited answer: a pipelined answer is booked, Shutdown stops us,
        an error means register again, and between answers the notices are read."""
        if isinstance(reply, (m.Ack, m.Lease)):
            self._on_answer(reply)
            return
        if isinstance(reply, m.Shutdown):
            raise StopActor(f"learner shut down ({reply.reason})")
        if isinstance(reply, m.ErrorReply) and reply.reason == m.BUSY:  # no room to verify our submission yet
            self._on_answer(reply)
            return
        if isinstance(reply, m.ErrorReply) and reply.reason in ("bad_version", "id_taken"):  # the same on every retry
            raise ActorRefused(f"the learner refused us: {reply.detail}")
        if isinstance(reply, m.ErrorReply):
            raise LearnerUnavailable(f"learner error {reply.reason}: {reply.detail}")
        self.notices.poll()
