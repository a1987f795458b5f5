"""The learner's event loop: a ROUTER for requests, a PUB for notices.

All socket work for the learner happens here (and in doorman.py, which watches its router); decisions are made
by the run's coordinator (learner/run/coordinator.py, seen through desk.py's `Desk`), which answers each message
with a typed `Reply` this loop sends as it is.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from functools import partial
from typing import Optional

import zmq
from pydantic import BaseModel

from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.door.answers import Answers
from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.learner.door.doorman import Doorman, check_bind_security
from grpo_fleet.learner.door.housekeeping import Housekeeping
from grpo_fleet.learner.door.intake_rules import inbound_limits
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.weights_in_flight import WeightsInFlight
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
from grpo_fleet.observe.metrics_http import MetricsServer, serve_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.endpoints import advertised, is_wildcard_host, pub_endpoint_for
from grpo_fleet.protocol.sockets import (
    bound_endpoint,
    decode_routed,
    make_context,
    pub_socket,
    recv_routed_frames,
    router_socket,
    send_message,
)

log = logging.getLogger("grpo_fleet.learner")

# After the last step, how long the learner waits for every actor to hear Shutdown.
SHUTDOWN_GRACE_SECONDS = 10.0


class LearnerServer:
    """Owns the sockets; pumps messages into the run and starts its training thread."""

    def __init__(self, learner: Desk) -> None:
        self.learner = learner
        cfg = learner.cfg.server
        self.limits = inbound_limits(learner.cfg)
        check_bind_security(learner.cfg)
        self.ctx = make_context()
        self.door = Doorman(self.ctx, learner.cfg, learner)
        keypair = self.door.keypair
        # libzmq drops a larger frame before it is buffered in Python.
        self.router = router_socket(self.ctx, cfg.bind, max_message_bytes=self.limits.max_message_bytes, curve=keypair)
        self.pub = pub_socket(self.ctx, cfg.pub_bind or pub_endpoint_for(cfg.bind), curve=keypair)
        self.door.watch(self.router)
        self.metrics_target: Optional[str] = None
        self.metrics_server: Optional[MetricsServer] = None
        self.endpoint = bound_endpoint(self.router)
        learner.pub_address = advertised(bound_endpoint(self.pub), cfg.advertise_host)
        self.stopping = False
        self.training_error: Optional[BaseException] = None
        self.answers = Answers(learner)  # what to say to each message: no sockets there
        # Rollouts whose rewards are re-scored are answered off this thread (learner/verify/verifier_thread.py).
        check = learner.verification.reward_check
        self.verifier: Optional[RolloutsVerifier[Reply]] = (
            RolloutsVerifier(cfg.verify_queue, interrupt=check.stop_replays) if check is not None else None)
        # Weight chunks queued zero-copy hold their version's blob until sent: bounded there.
        self.weights_in_flight = WeightsInFlight(learner.metrics)
        self.chores = Housekeeping(learner, self.door, self.weights_in_flight, self._publish)

    def start_metrics(self) -> None:
        """Serve /metrics and the service-discovery list /sd on the metrics port."""
        cfg = self.learner.cfg
        self.metrics_server = serve_metrics(self.learner.metrics.registry, cfg.metrics.host, cfg.metrics.port,
                                            sd_targets=lambda: self.learner.registry.sd_snapshot,
                                            max_connections=cfg.metrics.max_connections)
        if self.metrics_server is not None:
            host = cfg.metrics.host
            if is_wildcard_host(host):
                host = cfg.server.advertise_host or socket.gethostname()
            self.metrics_target = f"{host}:{self.metrics_server.port}"
            log.info("metrics on http://%s/metrics, service discovery on http://%s/sd", self.metrics_target, self.metrics_target)

    def request_stop(self, *_args: object) -> None:
        self.stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, self.door.request_reload)

    def serve(self) -> None:
        """Run until the step target is reached or a stop is requested.

        Training runs on its own thread so requests are answered while a step
        computes (MLX releases the GIL in its kernels): actors keep generating and
        the groups for step n+1 arrive while step n trains.
        """
        log.info("learner listening on %s (notices on %s)", self.endpoint, self.learner.pub_address)
        training = threading.Thread(target=self._train_loop, name="train", daemon=True)
        training.start()
        try:
            while not self.stopping and training.is_alive():
                self._pump(timeout_ms=20)
                self.chores.run(self.metrics_target)
                self.chores.announce_new_version()
            self.stopping = True
            training.join()
            self._stop_verifier()  # before the last checkpoint: nothing may be taken after it is written
            if self.training_error is not None:
                raise self.training_error
            self.chores.announce_new_version()
            if self.learner.state.done:
                self._say_goodbye()
            else:
                # Stopped early (signal): save everything; actors keep retrying and
                # carry on with a learner resumed from this checkpoint.
                self.learner.training.checkpoint()
        finally:
            self.stopping = True
            training.join()
            self._stop_verifier()
            self.close()

    def _train_loop(self) -> None:
        try:
            self.learner.training.run(lambda: self.stopping)
        except BaseException as exc:  # surfaced by serve() on the main thread
            self.training_error = exc

    def _pump(self, timeout_ms: int) -> None:
        """Answer every message that is waiting (bounded, so lease expiry and notices still get their turn)."""
        self._send_verified()
        if not self.router.poll(timeout_ms, zmq.POLLIN):
            self._send_verified()
            return
        for _ in range(256):
            if not self.router.poll(0, zmq.POLLIN):
                break
            received = recv_routed_frames(self.router)
            # The peer is judged before its message is decoded: a banned or revoked key costs no decode.
            if not self.door.admits(received.identity, received.principal):
                continue
            routed = decode_routed(received, self.limits)
            observer = self.door.is_observer(routed.principal)
            if self.verifier is not None and isinstance(routed.message, m.Rollouts) and not self.answers.closing and not observer:
                answer = partial(self.answers.rollouts, routed.identity, routed.message, routed.principal,
                                 routed.peer_address)
                if self.verifier.submit(routed.identity, peer_key(routed.identity, routed.principal), answer):
                    continue
                reply = self.answers.busy()
            else:
                reply = self.answers.answer(routed.identity, routed.message, routed.principal, routed.peer_address,
                                     observer=observer)
            self._reply(routed.identity, peer_key(routed.identity, routed.principal), reply)
        self._send_verified()

    def _reply(self, identity: bytes, owner: str, reply: Reply) -> None:
        """Send `reply`; a weight chunk only within the bound on the blobs queued chunks hold (weights_in_flight.py),
        else WeightsGone naming the current version, which the actor fetches again."""
        chunk = reply.message
        if not isinstance(chunk, m.WeightsChunk):
            send_message(self.router, chunk, identity=identity, raw=reply.raw)
        elif self.weights_in_flight.refusal(owner, chunk) is not None:
            gone = m.WeightsGone(requested=chunk.version, current=self.learner.snapshots.current.version)
            send_message(self.router, gone, identity=identity)
        else:
            tracker = send_message(self.router, chunk, identity=identity, raw=reply.raw, track=True)
            self.weights_in_flight.sent(owner, chunk, tracker)

    def _send_verified(self) -> None:
        """Send the Acks the verifier thread has worked out since last time."""
        for identity, reply in self.verifier.answers() if self.verifier is not None else []:
            send_message(self.router, reply.message, identity=identity, raw=reply.raw)

    def _stop_verifier(self) -> None:
        """Take no more Rollouts on the verifier thread (the one in hand is answered and sent; the queued ones are
        dropped unanswered, and resent by their actors); later ones are taken on this thread."""
        if self.verifier is not None:
            self.verifier.close()
            self._send_verified()
            self.verifier = None

    def _publish(self, msg: BaseModel) -> None:
        send_message(self.pub, msg)

    def _say_goodbye(self) -> None:
        """Tell every actor the run is over: on PUB, and as the reply to its next request.

        PUB alone can miss an actor whose SUB was reconnecting; the direct reply
        cannot, so linger (bounded) until each registered actor has heard it.
        """
        self.answers.closing = True
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        while time.monotonic() < deadline and set(self.learner.registry.actors) - self.answers.told_to_stop:
            self._publish(m.Shutdown(reason="done"))
            self._pump(timeout_ms=100)
        unheard = set(self.learner.registry.actors) - self.answers.told_to_stop
        if unheard:  # an actor that heard PUB answers it (actor/link.py answer_shutdown): these said nothing
            log.info("stopping: %d actors not heard from within %.0f s of the end; leaving without their answer",
                     len(unheard), SHUTDOWN_GRACE_SECONDS)

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.door.close(self.router)
        self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()
        self.learner.close()
