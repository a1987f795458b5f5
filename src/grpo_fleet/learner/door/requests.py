"""Who sent a request, what an observer key may ask, and the answers to requests no room takes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydantic import BaseModel

from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.learner")


@dataclass(frozen=True)
class Request:
    """Who sent a message: `owner` is the peer key leases and bans are bound to."""

    identity: bytes
    owner: str
    peer_address: str = ""


# What an observer key (`keys add-observer`) may ask; it can neither join, lease, submit nor read weights.
OBSERVER_REQUESTS = (m.StatusRequest,)


def refuse_observer(owner: str, msg: BaseModel, metrics: LearnerMetrics) -> m.ErrorReply:
    """An observer key asked for more than Status: counted, logged, refused."""
    metrics.auth_failures.labels(reason="observer").inc()
    log.warning("observer key %s sent %s; observers may ask Status only", shown(owner), type(msg).__name__)
    return m.ErrorReply(reason="forbidden", detail=f"an observer key may ask Status only, not {type(msg).__name__}")


def undecodable(owner: str, error: ProtocolError, metrics: LearnerMetrics, registry: Registry) -> m.ErrorReply:
    """The answer to a message that failed to decode: the sender's violation, unless the bug is ours."""
    if not error.is_violation:
        log.error("learner bug decoding a message from %s: %s", shown(owner), shown(error, 400),
                  exc_info=error.__cause__ or error)
        metrics.internal_errors.labels(where="decode").inc()
        return m.ErrorReply(reason=error.reason, detail="the learner failed on this message; not your fault")
    metrics.protocol_errors.labels(reason=error.reason).inc()
    registry.record_violation(owner, error.reason)
    return m.ErrorReply(reason=error.reason, detail=shown(error, 400))
