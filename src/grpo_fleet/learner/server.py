"""The learner's event loop: a ROUTER for requests, a PUB for notices.

All socket work for the learner happens here; decisions are made by `Learner`.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Optional
from urllib.parse import urlparse

import zmq

from grpo_fleet.learner.core import Learner
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import Limits, ProtocolError
from grpo_fleet.protocol.sockets import bound_endpoint, make_context, pub_socket, recv_routed, router_socket, send_message

log = logging.getLogger("grpo_fleet.learner")

# How long an actor may stay silent (in heartbeat periods) before its leases are re-queued.
SILENT_HEARTBEATS = 10
# After the last step, how long the learner waits for every actor to hear Shutdown.
SHUTDOWN_GRACE_SECONDS = 10.0


def pub_endpoint_for(bind: str) -> str:
    """Default PUB address: the ROUTER's host with the next port (or a random port)."""
    parsed = urlparse(bind)
    port = parsed.port or 0
    return f"tcp://{parsed.hostname}:{port + 1 if port else 0}"


def advertised(endpoint: str, advertise_host: Optional[str]) -> str:
    """The PUB endpoint as actors should dial it (a wildcard bind is replaced by the advertised host)."""
    parsed = urlparse(endpoint)
    host = advertise_host or parsed.hostname
    return f"tcp://{host}:{parsed.port}"


class LearnerServer:
    """Owns the sockets; pumps messages into `Learner` and trains when a batch is ready."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        cfg = learner.cfg.server
        self.limits = Limits(max_message_bytes=cfg.max_message_bytes, max_bin_len=cfg.max_message_bytes)
        self.ctx = make_context()
        self.router = router_socket(self.ctx, cfg.bind, max_message_bytes=cfg.max_message_bytes)
        self.pub = pub_socket(self.ctx, cfg.pub_bind or pub_endpoint_for(cfg.bind))
        self.endpoint = bound_endpoint(self.router)
        learner.pub_address = advertised(bound_endpoint(self.pub), cfg.advertise_host)
        self.stopping = False
        self.closing = False
        self.told_to_stop: set[bytes] = set()
        self._last_housekeeping = 0.0

    def request_stop(self, *_args: object) -> None:
        self.stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def serve(self) -> None:
        """Run until the step target is reached or a stop is requested."""
        log.info("learner listening on %s (notices on %s)", self.endpoint, self.learner.pub_address)
        try:
            while not self.stopping and not self.learner.done:
                self._pump(timeout_ms=0 if self.learner.ready_to_train() else 50)
                self._housekeeping()
                if self.learner.ready_to_train():
                    record = self.learner.train_step()
                    if record["published"]:
                        self._publish(m.PolicyUpdated(version=self.learner.version, digest=self.learner.snapshot.digest))
            if self.learner.done:
                self._say_goodbye()
            else:
                # Stopped early (signal): save everything; actors keep retrying and
                # carry on with a learner resumed from this checkpoint.
                self.learner.checkpoint()
        finally:
            self.close()

    def _pump(self, timeout_ms: int) -> None:
        """Answer every message that is waiting (bounded, so training is not starved)."""
        if not self.router.poll(timeout_ms, zmq.POLLIN):
            return
        for _ in range(256):
            if not self.router.poll(0, zmq.POLLIN):
                return
            identity, msg = recv_routed(self.router, self.limits)
            if self.learner.is_banned(identity):
                self.learner.metrics.protocol_errors.labels(reason="banned").inc()
                continue
            reply = self._answer(identity, msg)
            if reply is not None:
                send_message(self.router, reply, identity=identity)

    def _answer(self, identity: bytes, msg: object) -> Optional[object]:
        if self.closing:
            self.told_to_stop.add(identity)
            return m.Shutdown(reason="done")
        if isinstance(msg, ProtocolError):
            self.learner.metrics.protocol_errors.labels(reason=msg.reason).inc()
            self.learner.record_violation(identity)
            return m.ErrorReply(reason=msg.reason, detail=str(msg)[:500])
        try:
            return self.learner.handle(identity, msg)
        except Exception as exc:  # a bug must not take the learner down with it
            log.exception("error handling %s", type(msg).__name__)
            self.learner.metrics.protocol_errors.labels(reason="internal").inc()
            return m.ErrorReply(reason="internal", detail=type(exc).__name__)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        period = self.learner.cfg.server.heartbeat_seconds
        if now - self._last_housekeeping < min(0.5, period):
            return
        self._last_housekeeping = now
        self.learner.expire_leases()
        self._drop_silent_actors(now - SILENT_HEARTBEATS * period)
        self._publish(m.Heartbeat(actor_id="learner", policy_version=self.learner.version, sent_at=time.time()))

    def _drop_silent_actors(self, cutoff: float) -> None:
        for identity, info in list(self.learner.actors.items()):
            if info.last_seen < cutoff:
                released = self.learner.scheduler.release_actor(identity.hex())
                log.info("actor %s went silent; re-queued %d leases", info.actor_id, released)
                del self.learner.actors[identity]
        self.learner.metrics.actors_connected.set(len(self.learner.actors))

    def _publish(self, msg: object) -> None:
        send_message(self.pub, msg)

    def _say_goodbye(self) -> None:
        """Tell every actor the run is over: on PUB, and as the reply to its next request.

        PUB alone can miss an actor whose SUB was reconnecting; the direct reply
        cannot, so linger (bounded) until each registered actor has heard it.
        """
        self.closing = True
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        while time.monotonic() < deadline and set(self.learner.actors) - self.told_to_stop:
            self._publish(m.Shutdown(reason="done"))
            self._pump(timeout_ms=100)

    def close(self) -> None:
        self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()
        self.learner.close()
