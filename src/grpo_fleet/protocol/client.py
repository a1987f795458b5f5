"""A one-shot request to the learner, for tools such as `grpo-fleet status`.

It authenticates exactly like an actor (CURVE key on the learner's allow-list
when the learner runs with keys).
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import load_keypair
from grpo_fleet.protocol.sockets import dealer_socket, make_context, recv_message, send_message


def request_status(
    connect: str, *, key_file: Optional[str] = None, learner_key_file: Optional[str] = None, timeout_s: float = 10.0
) -> m.Status:
    """Ask the learner at `connect` for its Status; raises TimeoutError when it does not answer."""
    curve = None
    if key_file or learner_key_file:
        if not (key_file and learner_key_file):
            raise ValueError("CURVE needs both --key and --learner-key")
        curve = (load_keypair(key_file), load_keypair(learner_key_file).public)
    ctx = make_context()
    identity = f"status-{socket.gethostname()}-{os.getpid()}".encode()
    sock = dealer_socket(ctx, connect, identity=identity, max_message_bytes=16 << 20, curve=curve)
    try:
        send_message(sock, m.StatusRequest())
        reply = recv_message(sock, timeout_s=timeout_s)
    finally:
        sock.close(linger=0)
        ctx.term()
    if reply is None:
        raise TimeoutError(f"no answer from {connect} within {timeout_s:.0f}s (wrong address, or keys not allowed?)")
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
