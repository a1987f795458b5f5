"""The learner's event loop: a ROUTER for requests, a PUB for notices, and the run's two threads.

All socket work for the learner happens here (and in doorman.py, which watches its router): `RouterTransport`
is the door's `Transport` (transport.py) over ZeroMQ. What is done with each message, admission, decoding and
dispatch, is dispatch.py's, which sees only that protocol; decisions are made by the run's coordinator
(learner/run/coordinator.py, seen through desk.py's `Desk`), which answers each message with a typed `Reply`.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Optional

import zmq
from pydantic import BaseModel

from grpo_fleet.config import ServerConfig
from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.learner.door.dispatch import door_of
from grpo_fleet.learner.door.doorman import Doorman, check_bind_security
from grpo_fleet.learner.door.housekeeping import Housekeeping
from grpo_fleet.learner.door.intake_rules import inbound_limits
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.weights_in_flight import Tracker
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
from grpo_fleet.observe.metrics_http import MetricsServer, serve_metrics
from grpo_fleet.protocol.auth import Keypair
from grpo_fleet.protocol.codec import Limits
from grpo_fleet.protocol.endpoints import advertised, is_wildcard_host, pub_endpoint_for
from grpo_fleet.protocol.sockets import (
    RoutedFrames,
    bound_endpoint,
    make_context,
    pub_socket,
    recv_routed_frames,
    router_socket,
    send_message,
)

log = logging.getLogger("grpo_fleet.learner")

# After the last step, how long the learner waits for every actor to hear Shutdown.
SHUTDOWN_GRACE_SECONDS = 10.0


class RouterTransport:
    """The door's `Transport` over ZeroMQ: a ROUTER bound for requests, a PUB bound for notices."""

    def __init__(self, ctx: zmq.Context, cfg: ServerConfig, limits: Limits, keypair: Optional[Keypair]) -> None:
        # libzmq drops a larger frame before it is buffered in Python.
        self.router = router_socket(ctx, cfg.bind, max_message_bytes=limits.max_message_bytes, curve=keypair)
        self.pub = pub_socket(ctx, cfg.pub_bind or pub_endpoint_for(cfg.bind), curve=keypair)

    def receive(self, timeout_ms: int) -> Optional[RoutedFrames]:
        if not self.router.poll(timeout_ms, zmq.POLLIN):
            return None
        return recv_routed_frames(self.router)

    def reply(self, identity: bytes, message: BaseModel, raw: Optional[memoryview] = None, *,
              track: bool = False) -> Optional[Tracker]:
        return send_message(self.router, message, identity=identity, raw=raw, track=track)

    def publish(self, message: BaseModel) -> None:
        send_message(self.pub, message)

    def close(self) -> None:
        self.router.close(linger=0)
        self.pub.close(linger=0)


class LearnerServer:
    """Owns the sockets (its `RouterTransport`) and the run's threads: pumps what arrives through the door's
    dispatcher (dispatch.py), runs the chores between pumps, and starts and stops the training thread."""

    def __init__(self, learner: Desk) -> None:
        self.learner = learner
        check_bind_security(learner.cfg)
        limits = inbound_limits(learner.cfg)
        self.ctx = make_context()
        self.doorman = Doorman(self.ctx, learner.cfg, learner.metrics)
        self.transport = RouterTransport(self.ctx, learner.cfg.server, limits, self.doorman.keypair)
        self.doorman.watch(self.transport.router)
        self.endpoint = bound_endpoint(self.transport.router)
        learner.pub_address = advertised(bound_endpoint(self.transport.pub), learner.cfg.server.advertise_host)
        self.metrics_target: Optional[str] = None
        self.metrics_server: Optional[MetricsServer] = None
        self.stopping = False
        self.training_error: Optional[BaseException] = None
        self.dispatch = door_of(learner, self.transport, self.doorman.keyring, self._verifier())
        self.chores = Housekeeping(learner, self.doorman, self.dispatch.admission, self.dispatch.weights_in_flight,
                                   self.transport.publish)

    def _verifier(self) -> Optional[RolloutsVerifier[Reply]]:
        """Rollouts whose rewards are re-scored are answered off this thread (learner/verify/verifier_thread.py)."""
        check = self.learner.verification.reward_check
        if check is None:
            return None
        return RolloutsVerifier(self.learner.cfg.server.verify_queue, interrupt=check.stop_replays)

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
            signal.signal(signal.SIGHUP, self.dispatch.admission.request_reload)

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
                self.dispatch.pump(timeout_ms=20)
                self.chores.run(self.metrics_target)
                self.chores.announce_new_version()
            self.stopping = True
            training.join()
            self.dispatch.stop_verifier()  # before the last checkpoint: nothing may be taken after it is written
            if self.training_error is not None:
                raise self.training_error
            self.chores.announce_new_version()
            if self.learner.state.done:
                self.dispatch.say_goodbye(SHUTDOWN_GRACE_SECONDS)
            else:
                # Stopped early (signal): save everything; actors keep retrying and
                # carry on with a learner resumed from this checkpoint.
                self.learner.training.checkpoint()
        finally:
            self.stopping = True
            training.join()
            self.dispatch.stop_verifier()
            self.close()

    def _train_loop(self) -> None:
        try:
            self.learner.training.run(lambda: self.stopping)
        except BaseException as exc:  # surfaced by serve() on the main thread
            self.training_error = exc

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.doorman.close(self.transport.router)
        self.transport.close()
        self.ctx.term()
        self.learner.close()
