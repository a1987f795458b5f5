"""What the learner's loop says to each message, decided without a socket.

Kept apart from the loop (server.py), which only moves bytes: the coordinator's reply, Shutdown once the run is
closing, an internal error for a bug in a handler, and BUSY for Rollouts the verifier thread has no room for.
"""

from __future__ import annotations

import logging
from typing import Optional

from pydantic import BaseModel

from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.protocol.messages import BUSY
from grpo_fleet.protocol.reasons import RejectReason

log = logging.getLogger("grpo_fleet.learner")


class Answers:
    """Turns a decoded message (or its decode error) into the `Reply` to send; while `closing`, that is Shutdown,
    and the registered actors told so are kept in `told_to_stop`, which the loop waits for."""

    def __init__(self, learner: Desk) -> None:
        self.learner = learner
        self.closing = False
        self.told_to_stop: set[bytes] = set()

    def answer(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply:
        if self.closing:
            if identity in self.learner.registry.actors:  # only registered actors are waited for; keeps the set bounded
                self.told_to_stop.add(identity)
            return Reply(m.Shutdown(reason="done"))
        try:
            return self.learner.requests.handle(identity, msg, principal, peer_address, observer=observer)
        except Exception as exc:  # a bug must not take the learner down with it
            log.exception("error handling %s", type(msg).__name__)
            self.learner.metrics.internal_errors.labels(where="handle").inc()
            return Reply(m.ErrorReply(reason=RejectReason.INTERNAL.value, detail=type(exc).__name__))

    def rollouts(self, identity: bytes, msg: m.Rollouts, principal: Optional[str], peer_address: str) -> Reply:
        """On the verifier thread: `answer`, rewards scored outside the lock (`RequestHandlers.handle_rollouts`)."""
        try:
            with self.learner.metrics.rollouts_answer_seconds.time():
                return self.learner.requests.handle_rollouts(identity, msg, principal, peer_address)
        except Exception as exc:  # a bug must not take the learner down with it
            log.exception("error handling Rollouts")
            self.learner.metrics.internal_errors.labels(where="handle").inc()
            return Reply(m.ErrorReply(reason=RejectReason.INTERNAL.value, detail=type(exc).__name__))

    def busy(self) -> Reply:
        """The answer to Rollouts the verifier has no room for: counted, and resent by the actor shortly."""
        self.learner.metrics.fair_share_refusals.labels(reason="busy").inc()
        return Reply(m.ErrorReply(reason=BUSY, detail="the learner's verifier queue is full (server.verify_queue); "
                                  "resend this submission shortly"))
