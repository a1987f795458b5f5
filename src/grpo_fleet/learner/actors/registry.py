"""The learner's actors: hello, liveness, throughput, violations and bans, status and /sd.

Plain bookkeeping (no sockets). It feeds leases (who owns what), Prometheus
service discovery (`/sd`) and `grpo-fleet status`; the ban policy is in bans.py.
The speed measures (`MovingAverage`, `TokenRate`) are in rates.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from grpo_fleet.config import ServerConfig
from grpo_fleet.learner.actors.bans import Bans
from grpo_fleet.learner.actors.rates import MovingAverage, TokenRate
from grpo_fleet.learner.records.actor_ids import IDS_PER_SESSION, ActorIds
from grpo_fleet.learner.verify.trust import Trust
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown

if TYPE_CHECKING:
    from grpo_fleet.learner.records.state import LearnerState

log = logging.getLogger("grpo_fleet.learner")

@dataclass
class ActorInfo:
    """A registered actor."""

    actor_id: str
    host: str
    backend: str
    principal: str  # the CURVE public key when CURVE is on, else the routing id in hex
    last_seen: float
    metrics_target: Optional[str] = None  # "address:port" Prometheus can scrape
    policy_version: int = 0
    rate: TokenRate = field(default_factory=TokenRate)
    # Measured from returned leases; sizes its next leases (learner/actors/leasing.py).
    groups_per_second: MovingAverage = field(default_factory=MovingAverage)
    last_return: Optional[float] = None  # scheduler clock, when its last lease came back
    loading: bool = True  # welcomed and silent since: loading the run's model (the silence allowed is longer)

    def status(self, now: float) -> m.ActorStatus:
        return m.ActorStatus(
            actor_id=self.actor_id, host=self.host, backend=self.backend, policy_version=self.policy_version,
            tokens_per_second=self.rate.per_second(now), last_seen_seconds=max(0.0, now - self.last_seen),
            groups_per_second=self.groups_per_second.value,
        )


def is_silent(actor: ActorInfo, now: float, silence: float, load_grace: float) -> bool:
    """Whether `actor` has been quiet too long: `silence` seconds, or `load_grace` (if longer) while it has sent
    nothing since its Welcome, as it loads the run's model (it cannot heartbeat while it does)."""
    allowed = max(silence, load_grace) if actor.loading else silence
    return now - actor.last_seen > allowed


def actor_from_hello(hello: m.Hello, principal: str, peer_address: str) -> ActorInfo:
    """Register what an actor says about itself; its scrape address is where it connected from."""
    target = f"{_url_host(peer_address)}:{hello.metrics_port}" if hello.metrics_port and peer_address else None
    return ActorInfo(
        actor_id=hello.actor_id, host=hello.host, backend=hello.backend, principal=principal,
        last_seen=time.monotonic(), metrics_target=target,
    )


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def id_names(identity: bytes, actor_id: str) -> list[str]:
    """What a Hello binds to its key: its actor id, and the routing id the ROUTER answers it on (through which
    a takeover would otherwise go). An honest actor's routing id is its actor id: one name."""
    routing = identity.decode("ascii") if identity.isascii() else "routing:" + identity.hex()
    return list(dict.fromkeys([actor_id, routing]))


def sd_groups(learner_target: Optional[str], actors: list[ActorInfo]) -> list[dict]:
    """The JSON Prometheus `http_sd_configs` reads: the learner and every live actor."""
    groups = []
    if learner_target:
        groups.append({"targets": [learner_target], "labels": {"role": "learner"}})
    for actor in actors:
        if actor.metrics_target:
            groups.append({"targets": [actor.metrics_target], "labels": {"role": "actor", "actor": actor.actor_id}})
    return groups


@dataclass(frozen=True)
class RunCard:
    """What Welcome tells every actor about the run; fixed when the learner starts."""

    model: m.ModelRef
    generation: m.GenerationParams
    reward: m.RewardSpec
    heartbeat_seconds: float
    vocab_size: int
    env: Optional[m.EnvSpec] = None  # task.env: every prompt is an episode
    max_staleness: Optional[int] = None  # grpo.max_staleness: how far behind an actor may start new work

    def welcome(self, actor_id: str, state: LearnerState, pub_address: Optional[str]) -> m.Welcome:
        """The card, with what changes: the run id (kept across resumes), version and incarnation."""
        return m.Welcome(
            run_id=state.run_id, actor_id=actor_id, model=self.model, generation=self.generation, reward=self.reward,
            policy_version=state.version, heartbeat_seconds=self.heartbeat_seconds, pub_address=pub_address,
            vocab_size=self.vocab_size, incarnation=state.incarnation, env=self.env, max_staleness=self.max_staleness,
        )


class Registry:
    """Who is connected, under which key, how fast, and who is banned."""

    def __init__(self, server: ServerConfig, metrics: LearnerMetrics, trust: Optional[Trust] = None,
                 ids: Optional[ActorIds] = None) -> None:
        self.max_actors, self.max_sessions_per_key = server.max_actors, server.max_sessions_per_key
        self.ids_per_key = IDS_PER_SESSION * server.max_sessions_per_key
        self.metrics = metrics
        self.ids = ids if ids is not None else ActorIds()  # the run's: LearnerState.actor_ids, saved with it
        self.trust = trust  # the logprob check's record of each key: a Hello or a violation restarts its probation
        self.actors: dict[bytes, ActorInfo] = {}
        self.bans = Bans(server.max_violations, server.ban_seconds)
        self.rate = TokenRate()  # the whole fleet's accepted tokens
        self.groups_accepted = 0
        # Rebuilt on the main thread and swapped whole; the HTTP thread only reads it.
        self.sd_snapshot: list[dict] = []

    def hello(self, identity: bytes, owner: str, msg: m.Hello, peer_address: str) -> Optional[m.ErrorReply]:
        """Register (or re-register) an actor; the refusal when the registry (or its key's share of it) is full or
        its id is another key's, else None."""
        full = self._full(identity, owner)
        if full is not None:
            return full
        taken = self.ids.claim(id_names(identity, msg.actor_id), owner, self._in_use().__contains__, self.ids_per_key)
        if taken is not None and self.ids.owner(taken) is None:  # no room: every id it could free is in use
            self.metrics.protocol_errors.labels(reason="too_many_ids").inc()
            return m.ErrorReply(reason="too_many_ids", detail="every actor id this key may bind is in use; retry "
                                "when one of its actors leaves")
        if taken is not None:
            # Not a violation: two Macs given the same --actor-id is a mistake an honest user makes.
            self.metrics.auth_failures.labels(reason="id_taken").inc()
            log.warning("refused Hello from key %s as %s: that id belongs to another key in this run",
                        shown(owner), shown(taken))
            return m.ErrorReply(reason="id_taken", detail=f"the id {shown(taken)} belongs to another key in this run "
                                "(the first to use it keeps it); give this actor its own --actor-id")
        self.actors[identity] = actor_from_hello(msg, owner, peer_address)
        if self.trust is not None:  # either side restarted, or the link did: trust is earned again
            self.trust.begin_probation(owner)
        log.info("actor %s joined from %s (%s)", shown(msg.actor_id), shown(msg.host), shown(msg.backend))
        self.metrics.actors_connected.set(len(self.actors))
        return None

    def _full(self, identity: bytes, owner: str) -> Optional[m.ErrorReply]:
        """The refusal of a new session when the registry, or its key's share of it, is full; else None."""
        current = self.actors.get(identity)
        if current is not None and current.principal == owner:  # a live session saying Hello again
            return None
        if len(self.sessions_of(owner)) >= self.max_sessions_per_key:
            # One key must not fill the registry (and lock others out with too_many_actors), nor sum more caps.
            self.metrics.protocol_errors.labels(reason="too_many_sessions").inc()
            return m.ErrorReply(reason="too_many_sessions", detail=f"this key has {self.max_sessions_per_key} actors "
                                "registered (server.max_sessions_per_key); retry when one leaves")
        if current is None and len(self.actors) >= self.max_actors:
            # Throwaway identities must not grow the registry; a real actor retries with backoff.
            self.metrics.protocol_errors.labels(reason="too_many_actors").inc()
            return m.ErrorReply(reason="too_many_actors", detail=f"{len(self.actors)} actors registered "
                                "(server.max_actors); retry when one leaves")
        return None

    def _in_use(self) -> set[str]:
        """The names (actor ids and routing ids) live actors go by."""
        return {name for identity, info in self.actors.items() for name in id_names(identity, info.actor_id)}

    def sessions(self, owner: str) -> int:
        """Live sessions under one key (one key may run on two Macs)."""
        return len(self.sessions_of(owner))

    def key_count(self) -> int:
        """Keys with a live session: the in-flight budget's fair share is split among them (leasing.py)."""
        return len({info.principal for info in self.actors.values()})

    def sessions_of(self, owner: str) -> list[ActorInfo]:
        """The live sessions under one key."""
        return [info for info in self.actors.values() if info.principal == owner]

    def known(self, identity: bytes, owner: str) -> Optional[ActorInfo]:
        """The registered actor sending from `identity` under `owner` (now seen alive), or None.

        None is not a violation: every honest actor sends a few requests to a
        restarted learner before its next Hello, and answering is cheap. A request
        on an actor's routing id under another key is: that key took the
        connection over (ROUTER_HANDOVER), which no honest actor does.
        """
        actor = self.actors.get(identity)
        if actor is None or actor.principal != owner:
            self.metrics.protocol_errors.labels(reason="not_registered").inc()
            if actor is not None:
                self.metrics.auth_failures.labels(reason="id_taken").inc()
                self.record_violation(owner, "id_taken")
            return None
        actor.last_seen = time.monotonic()
        actor.loading = False
        return actor

    def peek(self, identity: bytes, owner: str) -> Optional[ActorInfo]:
        """The registered actor sending from `identity` under `owner`, or None; counts nothing (a look ahead
        of `known`, which the request's own handling still calls)."""
        actor = self.actors.get(identity)
        return actor if actor is not None and actor.principal == owner else None

    def drop(self, identity: bytes) -> Optional[ActorInfo]:
        """Forget an actor (silent or revoked); the caller re-queues its leases."""
        info = self.actors.pop(identity, None)
        if info is not None:
            self.metrics.actors_connected.set(len(self.actors))
        return info

    def credit(self, actor: ActorInfo, tokens: int, version: int) -> None:
        """Count one accepted group toward its actor's and the fleet's throughput."""
        actor.rate.add(tokens)
        actor.policy_version = max(actor.policy_version, version)
        self.rate.add(tokens)
        self.groups_accepted += 1

    def record_violation(self, key: str, reason: str, *, ban_now: bool = False) -> None:
        """Count malformed or hostile input from a peer key (see learner/actors/bans.py); `ban_now` bans it at once."""
        self.metrics.violations.labels(reason=reason).inc()
        if self.trust is not None:
            self.trust.begin_probation(key)
        if self.bans.record(key, self.bans.max_violations if ban_now else 1):
            self.metrics.bans.inc()
            times = self.bans.times_banned(key)  # bans double: say how long this one lasts
            log.warning("peer %s banned for %.0fs (ban %d) after violations (last: %s)", key,
                        self.bans.length(times), times, reason)
        self.metrics.banned_peers.set(self.bans.banned_count())

    def is_banned(self, key: str) -> bool:
        return self.bans.is_banned(key)

    def status(self, state: LearnerState) -> m.Status:
        """The run at a glance, for `grpo-fleet status`."""
        now = time.monotonic()
        return m.Status(
            run_id=state.run_id, step=state.step, steps_target=state.steps_target, policy_version=state.version,
            tokens_per_second=self.rate.per_second(now), groups_accepted=self.groups_accepted,
            actors=[info.status(now) for info in self.actors.values()],
        )

    def refresh_service_discovery(self, learner_target: Optional[str]) -> None:
        """Rebuild the /sd answer: the learner's own scrape address and every live actor's."""
        self.sd_snapshot = sd_groups(learner_target, list(self.actors.values()))
