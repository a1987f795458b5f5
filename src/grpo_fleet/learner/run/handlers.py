"""The I/O thread's part of the run: which function answers each message type, all under the run's lock.

Each entry of the two tables names one function. Rollouts go to the room that
owns their lease: an eval round's (learner/evals) or intake's (learner/door),
which take them alike (learner/door/rollouts_taker.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

from pydantic import BaseModel

from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.actors.leasing import Leasing
from grpo_fleet.learner.actors.registry import ActorInfo, Registry, RunCard
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.requests import OBSERVER_REQUESTS, Request, refuse_observer, undecodable
from grpo_fleet.learner.door.rollouts_taker import RolloutsTaker
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.learner")

# Handlers for anyone, and for registered actors only; each message type has one.
OpenHandler = Callable[[Request, Any], Reply]
ActorHandler = Callable[[ActorInfo, Any], Reply]
# An actor heard from within this many heartbeat periods is still at work on its leases (it heartbeats between
# decoding steps): those past their deadline are extended (leasing.extend_leases), not re-queued.
WORKING_HEARTBEATS = 3


class RequestHandlers:
    """Answers each decoded request (on the I/O thread, or Rollouts on the verifier thread) under the run's `lock`.

    Rollouts go to `evaluation` when it claims their lease, else to `intake`; `pub_address` is what Welcome
    names for notices (set once the loop has bound its PUB).
    """

    def __init__(self, lock: AbstractContextManager[Any], state: LearnerState, registry: Registry, leasing: Leasing,
                 evaluation: Evaluation, intake: RolloutsTaker, snapshots: SnapshotStore, card: RunCard,
                 metrics: LearnerMetrics, heartbeat_seconds: float, pub_address: Optional[str] = None) -> None:
        self.lock, self.state, self.registry, self.leasing = lock, state, registry, leasing
        self.evaluation, self.intake, self.snapshots, self.card = evaluation, intake, snapshots, card
        self.metrics, self.heartbeat_seconds, self.pub_address = metrics, heartbeat_seconds, pub_address
        # Answered for anyone; every other request needs a Hello from this identity first.
        self.open: dict[type, OpenHandler] = {m.Hello: self.hello, m.StatusRequest: self.status}
        self.registered: dict[type, ActorHandler] = {
            m.Heartbeat: self.heartbeat,
            m.GetWeights: self.weights,
            m.LeaseRequest: self.lease,
            m.Rollouts: self.rollouts,
        }

    def handle(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply:
        """Answer one decoded message (or a decoding failure) from `identity`.

        `principal` is the authenticated CURVE key; leases are bound to it, so a
        peer reusing another actor's routing id cannot act for it. An `observer`
        key (`keys add-observer`) may ask Status and nothing else.
        """
        owner = peer_key(identity, principal)
        with self.lock:
            if isinstance(msg, ProtocolError):
                return Reply(undecodable(owner, msg, self.metrics, self.registry))
            if observer and not isinstance(msg, OBSERVER_REQUESTS):
                return Reply(refuse_observer(owner, msg, self.metrics))
            return self._dispatch(Request(identity, owner, peer_address), msg)

    def handle_rollouts(self, identity: bytes, msg: m.Rollouts, principal: Optional[str] = None,
                        peer_address: str = "") -> Reply:
        """`handle` for Rollouts, with the rewards re-scored first, outside the lock (the verifier thread only).

        Scoring is a round trip to the reward process, as slow as the task's
        reward; under the lock it would hold every other request that long.
        What is scored is what `take` will accept; if the state moved meanwhile,
        `take` scores the rest itself.
        """
        with self.lock:
            # Not `known`: that counts an unregistered sender, and `handle` below does so once already.
            actor = self.registry.peek(identity, peer_key(identity, principal))
            owner = self.rollouts_owner(msg)
            jobs = owner.reward_jobs(actor, msg) if actor is not None else []
            check = owner.reward_check
        if check is None or not jobs:
            return self.handle(identity, msg, principal, peer_address)
        check.score_ahead(jobs)
        try:
            return self.handle(identity, msg, principal, peer_address)
        finally:
            check.forget_ahead()

    def drop_actor(self, identity: bytes) -> int:
        """Forget an actor (silent or revoked) and re-queue its leases; returns the lease count."""
        with self.lock:
            info = self.registry.drop(identity)
            if info is None:
                return 0
            self.evaluation.release_actor(info.principal)
            return self.state.scheduler.release_actor(info.principal)

    def expire_leases(self) -> int:
        """Re-queue leases past their deadline, but extend those of actors still at work (up to
        server.max_lease_seconds); returns how many expired."""
        with self.lock:
            self.evaluation.expire(self.still_working)
            return self.leasing.expire(self.still_working)

    def still_working(self, key: str) -> bool:
        """Whether a session of an actor key was heard from within WORKING_HEARTBEATS heartbeat periods."""
        cutoff = time.monotonic() - WORKING_HEARTBEATS * self.heartbeat_seconds
        return any(session.last_seen >= cutoff for session in self.registry.sessions_of(key))

    def refresh_service_discovery(self, learner_target: Optional[str]) -> None:
        """Rebuild the /sd answer on the main thread; the HTTP thread reads the list it swaps in."""
        with self.lock:
            self.registry.refresh_service_discovery(learner_target)

    def rollouts_owner(self, msg: m.Rollouts) -> RolloutsTaker:
        """The room whose lease this is: an eval round's (or eval groups no round waits for), else intake."""
        return self.evaluation if self.evaluation.claims(msg) else self.intake

    def _dispatch(self, req: Request, msg: BaseModel) -> Reply:
        kind = type(msg)
        if kind in self.open:
            return self.open[kind](req, msg)
        actor = self.registry.known(req.identity, req.owner)
        if actor is None:
            return Reply(m.ErrorReply(reason="not_registered", detail="send Hello first"))
        handler = self.registered.get(kind)
        if handler is None:
            self.metrics.protocol_errors.labels(reason="unexpected_type").inc()
            self.registry.record_violation(req.owner, "unexpected_type")
            return Reply(m.ErrorReply(reason="unexpected_type", detail=f"{kind.__name__} is not a request"))
        return handler(actor, msg)

    def hello(self, req: Request, hello: m.Hello) -> Reply:
        refusal = self.registry.hello(req.identity, req.owner, hello, req.peer_address)
        if refusal is not None:
            return Reply(refusal)
        # A restarted actor, or one reconnecting to a resumed learner, will never
        # return the leases it does not name; unless its key has another live
        # session (one key on two Macs), hand them out again now.
        if self.registry.sessions(req.owner) == 1:
            released = self.state.scheduler.release_actor(req.owner, keep=frozenset(hello.holding))
            if released:
                log.info("actor %s came back without %d of its leases; re-queued them", shown(hello.actor_id), released)
        return Reply(self.card.welcome(hello.actor_id, self.state, self.pub_address))

    def status(self, req: Request, request: m.StatusRequest) -> Reply:
        return Reply(self.registry.status(self.state))

    def heartbeat(self, actor: ActorInfo, beat: m.Heartbeat) -> Reply:
        state = self.state
        actor.policy_version = beat.policy_version
        return Reply(m.Heartbeat(actor_id=actor.actor_id, policy_version=state.version, sent_at=time.time(),
                                 incarnation=state.incarnation))

    def weights(self, actor: ActorInfo, request: m.GetWeights) -> Reply:
        return self.snapshots.chunk(request)

    def lease(self, actor: ActorInfo, request: m.LeaseRequest) -> Reply:
        # Eval leases go first: a round is small, and its figures are for the version it started at.
        return Reply(self.evaluation.grant(actor, request) or self.leasing.grant(actor, request))

    def rollouts(self, actor: ActorInfo, msg: m.Rollouts) -> Reply:
        return Reply(self.rollouts_owner(msg).take(actor, msg))
