"""What the learner's loop says to each message, decided without a socket.

Kept apart from the loop (dispatch.py), which admits, decodes and sends: the coordinator's reply, Shutdown once the run is
closing, an internal error for a bug in a handler, and BUSY for Rollouts the verifier thread has no room for.
"""

from __future__ import annotations

import logging
from typing import Optional

from pydantic import BaseModel

from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.desk import RequestDesk
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.protocol.messages import BUSY
from grpo_fleet.protocol.reasons import RejectReason

log = logging.getLogger("grpo_fleet.learner")


class Answers:
    """Turns a decoded message (or its decode error) into the `Reply` to send; while `closing`, that is Shutdown,
    and the registered actors told so are kept in `told_to_stop`, which the loop waits for."""

    def __init__(self, requests: RequestDesk, registry: Registry, metrics: LearnerMetrics) -> None:
        self.requests, self.registry, self.metrics = requests, registry, metrics
        self.closing = False
        self.told_to_stop: set[bytes] = set()

    def answer(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply:
        if self.closing:
            if identity in self.registry.actors:  # only registered actors are waited for; keeps the set bounded
                self.told_to_stop.add(identity)
            return Reply(m.Shutdown(reason="done"))
        try:
            return self.requests.handle(identity, msg, principal, peer_address, observer=observer)
        except Exception as exc:  # a bug must not take the learner down with it
            log.exception("error handling %s", type(msg).__name__)
            self.metrics.internal_errors.labels(where="handle").inc()
            return Reply(m.ErrorReply(reason=RejectReason.INTERNAL.value, detail=type(exc).__name__))

    def rollouts(self, identity: bytes, msg: m.Rollouts, principal: Optional[str], peer_address: str) -> Reply:
        """On the verifier thread: `answer`, rewards scored outside the lock (`RequestHandlers.handle_rollouts`)."""
        try:
            with self.metrics.rollouts_answer_seconds.time():
                return self.requests.handle_rollouts(identity, msg, principal, peer_address)
        except Exception as exc:  # a bug must not take the learner down with it
            log.exception("error handling Rollouts")
            self.metrics.internal_errors.labels(where="handle").inc()
            return Reply(m.ErrorReply(reason=RejectReason.INTERNAL.value, detail=type(exc).__name__))

    def unheard(self) -> set[bytes]:
        """The registered actors not yet told that the run is over."""
        return set(self.registry.actors) - self.told_to_stop

    def busy(self) -> Reply:
        """The answer to Rollouts the verifier has no room for: counted, and resent by the actor shortly."""
        self.metrics.fair_share_refusals.labels(reason="busy").inc()
        return Reply(m.ErrorReply(reason=BUSY, detail="the learner's verifier queue is full (server.verify_queue); "
                                  "resend this submission shortly"))
