"""Who may talk to the learner: the bind's security check, CURVE's allow-list, failed handshakes, bans.

Part of the learner's event loop (server.py), which owns the sockets it watches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.protocol.auth import Keypair, KeyRing, load_keypair, start_authenticator
from grpo_fleet.protocol.endpoints import is_loopback_endpoint, pub_endpoint_for
from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.learner")

HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_other",
}


class InsecureBindError(RuntimeError):
    """A non-loopback bind without CURVE and without an explicit --insecure."""


def check_bind_security(cfg: RunConfig) -> None:
    """Refuse to expose the learner to a network without CURVE unless the user insists."""
    endpoints = [cfg.server.bind, cfg.server.pub_bind or pub_endpoint_for(cfg.server.bind)]
    exposed = [e for e in endpoints if not is_loopback_endpoint(e)]
    if not exposed or cfg.security.keys_dir:
        return
    if not cfg.security.insecure:
        raise InsecureBindError(
            f"refusing to listen on {', '.join(exposed)} without CURVE: anyone who reaches it could "
            "feed the learner rollouts or read its weights. Create keys with `grpo-fleet keys init DIR` and "
            "set security.keys_dir (or --keys DIR), bind 127.0.0.1, or pass --insecure if you really mean it."
        )
    log.warning("!!! INSECURE: learner listening on %s without CURVE; any peer can join !!!", ", ".join(exposed))


class Doorman:
    """Who may talk to the learner: CURVE's allow-list (reloaded live), failed handshakes, banned and revoked keys."""

    def __init__(self, ctx: zmq.Context, cfg: RunConfig, learner: Desk) -> None:
        self.learner = learner
        self.keyring: Optional[KeyRing] = None
        self.keypair: Optional[Keypair] = None
        self.auth: Optional[ThreadAuthenticator] = None
        self.monitor: Optional[zmq.Socket] = None
        self.reload_requested = False
        if cfg.security.keys_dir:
            keys = Path(cfg.security.keys_dir)
            self.keypair = load_keypair(keys / "learner.key_secret")
            self.keyring = KeyRing(keys / "authorized")
            self.auth = start_authenticator(ctx, self.keyring)
            log.info("CURVE on: %d authorised keys in %s", len(self.keyring), self.keyring.directory)

    def watch(self, router: zmq.Socket) -> None:
        """Count the router's failed handshakes and dropped connections (they never reach the loop as messages).

        libzmq drops a message over the router's MAXMSGSIZE, and the sender's
        connection with it, without a word to the loop: the disconnect event is
        the only trace it leaves. Its event looks the same as an actor leaving.
        """
        self.monitor = router.get_monitor_socket(sum(HANDSHAKE_FAILURES) | zmq.EVENT_DISCONNECTED)

    def request_reload(self, *_args: object) -> None:
        self.reload_requested = True

    def admits(self, identity: bytes, principal: Optional[str]) -> bool:
        """Drop messages from banned peers and from keys revoked after their handshake."""
        if self.learner.registry.is_banned(peer_key(identity, principal)):
            self.learner.metrics.protocol_errors.labels(reason="banned").inc()
            return False
        if self.keyring is not None and not (principal and self.keyring.allows(principal.encode())):
            self.learner.metrics.auth_failures.labels(reason="revoked").inc()
            self.learner.requests.drop_actor(identity)
            return False
        return True

    def is_observer(self, principal: Optional[str]) -> bool:
        """Whether this CURVE key may only ask for the run's status (`keys add-observer`)."""
        return self.keyring is not None and principal is not None and self.keyring.is_observer(principal.encode())

    def count_connection_events(self) -> None:
        while self.monitor is not None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.learner.metrics.connections_dropped.inc()
                continue
            reason = HANDSHAKE_FAILURES.get(event["event"])
            if reason is not None:
                self.learner.metrics.auth_failures.labels(reason=reason).inc()
                log.warning("handshake failed on %s (%s)", shown(event["endpoint"].decode(errors="replace")), reason)

    def reload_allow_list(self) -> None:
        """SIGHUP or a change in the authorized/ directory: re-read keys, cut off revoked actors."""
        if self.keyring is None:
            return
        changed = self.keyring.reload() if self.reload_requested else self.keyring.reload_if_changed()
        self.reload_requested = False
        if not changed:
            return
        for identity, info in list(self.learner.registry.actors.items()):
            if not self.keyring.allows(info.principal.encode()):
                released = self.learner.requests.drop_actor(identity)
                log.warning("actor %s (%s) revoked; re-queued %d leases", shown(info.actor_id), shown(info.principal), released)

    def close(self, router: zmq.Socket) -> None:
        if self.monitor is not None:
            router.disable_monitor()
            self.monitor.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
