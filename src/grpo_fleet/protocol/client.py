"""A blocking request/reply client of the learner, one request at a time, for tools and benchmarks.

It authenticates exactly like an actor (CURVE key on the learner's allow-list
when the learner runs with keys). The actor's own link pipelines its requests
and lives with the actor.
"""

from __future__ import annotations

import os
import socket
from types import TracebackType
from typing import TYPE_CHECKING, Optional, Union

from pydantic import BaseModel

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import client_curve
from grpo_fleet.protocol.codec import DEFAULT_LIMITS, Limits, encode
from grpo_fleet.protocol.sockets import dealer_socket, make_context, recv_message, send_frames

if TYPE_CHECKING:
    import zmq

    from grpo_fleet.protocol.auth import Keypair

# `grpo-fleet status` answers are a few kB per actor; this leaves room for thousands.
STATUS_MAX_BYTES = 16 << 20


class Client:
    """A DEALER that sends one request and waits for its answer. Use it as a context manager.

    `ctx` shares a context with other sockets of the caller; without it the client
    makes its own and ends it on close.
    """

    def __init__(
        self,
        connect: str,
        *,
        identity: Union[str, bytes],
        curve: Optional[tuple["Keypair", bytes]] = None,
        limits: Limits = DEFAULT_LIMITS,
        ctx: Optional["zmq.Context"] = None,
    ) -> None:
        self.connect = connect
        self.limits = limits
        self._own_ctx = ctx is None
        self.ctx = make_context() if ctx is None else ctx
        raw_identity = identity.encode() if isinstance(identity, str) else identity
        self.socket = dealer_socket(self.ctx, connect, identity=raw_identity,
                                    max_message_bytes=limits.max_message_bytes, curve=curve)

    def request(self, msg: BaseModel, timeout_s: float) -> BaseModel:
        """Send `msg`, return the answer; TimeoutError when none comes within `timeout_s`."""
        return self.request_encoded(encode(msg), timeout_s)

    def request_encoded(self, payload: bytes, timeout_s: float) -> BaseModel:
        """Like `request`, for a payload encoded (or hand-built) beforehand."""
        send_frames(self.socket, [payload])
        return self.receive(timeout_s)

    def receive(self, timeout_s: float) -> BaseModel:
        """The learner's next message; TimeoutError when none comes within `timeout_s`."""
        reply = recv_message(self.socket, timeout_s=timeout_s, limits=self.limits)
        if reply is None:
            raise TimeoutError(f"no reply from {self.connect} within {timeout_s:g} s")
        return reply

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(
        self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()


def request_status(
    connect: str, *, key_file: Optional[str] = None, learner_key_file: Optional[str] = None, timeout_s: float = 10.0
) -> m.Status:
    """Ask the learner at `connect` for its Status; raises TimeoutError when it does not answer."""
    curve = client_curve(key_file, learner_key_file)
    identity = f"status-{socket.gethostname()}-{os.getpid()}"
    limits = Limits(max_message_bytes=STATUS_MAX_BYTES, max_bin_len=STATUS_MAX_BYTES)
    with Client(connect, identity=identity, curve=curve, limits=limits) as client:
        try:
            reply = client.request(m.StatusRequest(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"no answer from {connect} within {timeout_s:.0f}s (wrong address, or keys not allowed?)"
            ) from None
    if isinstance(reply, m.ErrorReply):
        raise RuntimeError(f"learner refused: {reply.reason} {reply.detail}")
    if not isinstance(reply, m.Status):
        raise RuntimeError(f"unexpected answer {type(reply).__name__}")
    return reply


def format_status(status: m.Status) -> str:
    """The table `grpo-fleet status` prints."""
    lines = [
        f"run {status.run_id}  step {status.step}/{status.steps_target}  policy v{status.policy_version}  "
        f"{status.tokens_per_second:,.0f} tok/s accepted  {status.groups_accepted} groups",
        "",
        f"{'actor':<24} {'host':<20} {'backend':<16} {'version':>7} {'tok/s':>9} {'groups/s':>9} {'last seen':>10}",
    ]
    for actor in sorted(status.actors, key=lambda a: a.actor_id):
        groups = "-" if actor.groups_per_second is None else f"{actor.groups_per_second:.2f}"
        lines.append(
            f"{actor.actor_id[:24]:<24} {actor.host[:20]:<20} {actor.backend[:16]:<16} {actor.policy_version:>7} "
            f"{actor.tokens_per_second:>9,.0f} {groups:>9} {actor.last_seen_seconds:>9.1f}s"
        )
    if not status.actors:
        lines.append("(no actors connected)")
    return "\n".join(lines)
