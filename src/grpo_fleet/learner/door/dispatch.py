"""What the learner's loop does with each message its transport receives: admit, decode, dispatch, reply.

No socket here: the frames come from a `Transport` (transport.py; server.py's is ZeroMQ), and the replies go
back through it. A peer is judged (admission.py) before its message is decoded; Rollouts whose rewards are
re-scored go to the verifier thread (learner/verify/verifier_thread.py), every other message is answered at
once (answers.py); a weight chunk is sent only within the bound on the blobs queued chunks hold
(weights_in_flight.py).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Optional

from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.door.admission import Admission
from grpo_fleet.learner.door.answers import Answers
from grpo_fleet.learner.door.desk import Desk
from grpo_fleet.learner.door.intake_rules import inbound_limits
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.door.transport import Transport
from grpo_fleet.learner.door.weights_in_flight import WeightsInFlight
from grpo_fleet.learner.verify.verifier_thread import RolloutsVerifier
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import KeyRing
from grpo_fleet.protocol.codec import Limits
from grpo_fleet.protocol.sockets import Routed, RoutedFrames, decode_routed

log = logging.getLogger("grpo_fleet.learner")

# Messages answered per pump at most, so lease expiry and notices still get their turn under a flood.
MESSAGES_PER_PUMP = 256


class Dispatcher:
    """Admits, decodes and answers what `transport` receives; Rollouts to be re-scored go to `verifier` (None:
    rewards are not re-scored, and Rollouts are answered at once like the rest)."""

    def __init__(self, transport: Transport, admission: Admission, answers: Answers, limits: Limits,
                 verifier: Optional[RolloutsVerifier[Reply]], weights_in_flight: WeightsInFlight,
                 snapshots: SnapshotStore) -> None:
        self.transport, self.admission, self.answers, self.limits = transport, admission, answers, limits
        self.verifier, self.weights_in_flight, self.snapshots = verifier, weights_in_flight, snapshots

    def pump(self, timeout_ms: int) -> None:
        """Answer every message that is waiting, after waiting at most `timeout_ms` for the first (bounded)."""
        self.send_verified()
        received, taken = self.transport.receive(timeout_ms), 0
        while received is not None:
            self._take(received)
            taken += 1
            received = self.transport.receive(0) if taken < MESSAGES_PER_PUMP else None
        self.send_verified()

    def _take(self, received: RoutedFrames) -> None:
        # The peer is judged before its message is decoded: a banned or revoked key costs no decode.
        if not self.admission.admits(received.identity, received.principal):
            return
        routed = decode_routed(received, self.limits)
        owner = peer_key(routed.identity, routed.principal)
        observer = self.admission.is_observer(routed.principal)
        if self.verifier is None or not isinstance(routed.message, m.Rollouts) or self.answers.closing or observer:
            reply = self.answers.answer(routed.identity, routed.message, routed.principal, routed.peer_address,
                                        observer=observer)
        elif self.verifier.submit(routed.identity, owner, self._verified_answer(routed)):
            return
        else:
            reply = self.answers.busy()
        self._reply(routed.identity, owner, reply)

    def _verified_answer(self, routed: Routed) -> partial[Reply]:
        """The verifier thread's job for a Rollouts: its answer, worked out there."""
        assert isinstance(routed.message, m.Rollouts)
        return partial(self.answers.rollouts, routed.identity, routed.message, routed.principal, routed.peer_address)

    def _reply(self, identity: bytes, owner: str, reply: Reply) -> None:
        """Send `reply`; a weight chunk only within the bound on the blobs queued chunks hold (weights_in_flight.py),
        else WeightsGone naming the current version, which the actor fetches again."""
        chunk = reply.message
        if not isinstance(chunk, m.WeightsChunk):
            self.transport.reply(identity, chunk, reply.raw)
        elif self.weights_in_flight.refusal(owner, chunk) is not None:
            self.transport.reply(identity, m.WeightsGone(requested=chunk.version, current=self.snapshots.current.version))
        else:
            tracker = self.transport.reply(identity, chunk, reply.raw, track=True)
            self.weights_in_flight.sent(owner, chunk, tracker)

    def send_verified(self) -> None:
        """Send the Acks the verifier thread has worked out since last time."""
        for identity, reply in self.verifier.answers() if self.verifier is not None else []:
            self.transport.reply(identity, reply.message, reply.raw)

    def stop_verifier(self) -> None:
        """Take no more Rollouts on the verifier thread (the one in hand is answered and sent; the queued ones are
        dropped unanswered, and resent by their actors); later ones are answered at once."""
        if self.verifier is not None:
            self.verifier.close()
            self.send_verified()
            self.verifier = None

    def say_goodbye(self, grace_seconds: float) -> None:
        """Tell every actor the run is over: on PUB, and as the reply to its next request.

        PUB alone can miss an actor whose SUB was reconnecting; the direct reply
        cannot, so linger (bounded) until each registered actor has heard it.
        """
        self.answers.closing = True
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and self.answers.unheard():
            self.transport.publish(m.Shutdown(reason="done"))
            self.pump(timeout_ms=100)
        unheard = self.answers.unheard()
        if unheard:  # an actor that heard PUB answers it (actor/link.py answer_shutdown): these said nothing
            log.info("stopping: %d actors not heard from within %.0f s of the end; leaving without their answer",
                     len(unheard), grace_seconds)


def door_of(learner: Desk, transport: Transport, keyring: Optional[KeyRing],
            verifier: Optional[RolloutsVerifier[Reply]]) -> Dispatcher:
    """The door of a run: `transport` judged with `keyring` (None: no CURVE), answered by the run's handler table,
    Rollouts re-scored on `verifier`, weight chunks bounded (weights_in_flight.py)."""
    admission = Admission(keyring, learner.registry, learner.metrics, learner.requests.drop_actor)
    answers = Answers(learner.requests, learner.registry, learner.metrics)
    return Dispatcher(transport, admission, answers, inbound_limits(learner.cfg), verifier,
                      WeightsInFlight(learner.metrics), learner.snapshots)
