"""The actor's loop: register, follow the learner's version, lease, generate, score, submit, drain.

The rooms it calls: `admission` (what it agrees to run), `link` (the pipelined
request/reply to the learner), `pipeline` (what is in flight), `weights_sync`
(snapshots), `rewarding` (the rewards' process, scoring), `streaming` (single-turn
leases through one rolling batch), `episodes` (a lease of episodes at a time) and
`wire` (conversion to messages). Actors are stateless: anything lost with an
actor is re-queued by the learner's leases.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import signal
import socket
import time
from typing import Optional

import mlx.core as mx

from grpo_fleet import native
from grpo_fleet.actor import wire
from grpo_fleet.actor.admission import ActorRefused, ModelKey, admit, plan_rewards
from grpo_fleet.actor.episodes import RunEpisodes
from grpo_fleet.actor.link import Answer, LearnerLink, LearnerUnavailable, Notice, StopActor
from grpo_fleet.actor.one_lease import OneLeaseAtATime
from grpo_fleet.actor.pipeline import InFlight
from grpo_fleet.actor.rewarding import RunRewards
from grpo_fleet.actor.streaming import LeaseStream, Turn
from grpo_fleet.actor.weights_sync import WeightsSync
from grpo_fleet.config import ActorConfig, MetricsConfig
from grpo_fleet.models.generation import generate_groups
from grpo_fleet.models.loading import Policy, load_policy
from grpo_fleet.models.native_functions import use_native_decoding
from grpo_fleet.observe.metrics import ActorMetrics, actor_metrics
from grpo_fleet.observe.metrics_http import MetricsServer, serve_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.runtime.doctor import mlx_version

__all__ = ["ActorRefused", "ActorWorker", "default_actor_id", "serve_actor_metrics"]

log = logging.getLogger("grpo_fleet.actor")
MAX_BACKOFF_SECONDS = 10.0
# How long an actor waits before resending a submission the learner had no room to verify (BUSY).
BUSY_RESEND_SECONDS = 0.5


def default_actor_id() -> str:
    """host-pid, the hostname cut down to the characters the learner accepts in an actor id."""
    host = re.sub(f"[^{m.ACTOR_ID_CHARS}]", "-", socket.gethostname()).lstrip("._:@+-") or "actor"
    return f"{host[:100]}-{os.getpid()}"


def serve_actor_metrics(metrics: ActorMetrics, cfg: MetricsConfig) -> Optional[MetricsServer]:
    """Serve /metrics (None when port 0 disables it); if the port is taken (a second actor on this Mac), take any free one.

    The learner learns the real port from Hello, so service discovery still finds it.
    """
    try:
        return serve_metrics(metrics.registry, cfg.host, cfg.port, max_connections=cfg.max_connections)
    except OSError as exc:
        log.warning("metrics port %d unavailable (%s); using a free port instead", cfg.port, exc)
        return serve_metrics(metrics.registry, cfg.host, 0, any_port=True, max_connections=cfg.max_connections)


class ActorWorker:
    """One actor process."""

    def __init__(self, cfg: ActorConfig) -> None:
        self.cfg = cfg
        self.actor_id = cfg.actor_id or default_actor_id()
        self.metrics = actor_metrics()
        self.link = LearnerLink(cfg, self.actor_id, on_answer=self._on_answer, on_notice=self._on_notice)
        self.inflight = InFlight()
        self.weights = WeightsSync(self.metrics)
        self.policy: Optional[Policy] = None
        self.model_key: Optional[ModelKey] = None
        self.rewards = RunRewards()  # the rewards' own process, started on admission
        self.episodes = RunEpisodes()  # the environment's own process, when the run has one (Welcome.env)
        self.stream = LeaseStream(self.link, self.inflight, self.metrics, cfg.max_groups, alone=self._rollout,
                                  score=self.rewards.score)
        self.one_lease = OneLeaseAtATime(self.link, self.inflight, cfg.max_groups, stopping=lambda: self.stopping,
                                         sleep=self._sleep, rollout=self._rollout)
        self.welcome: Optional[m.Welcome] = None
        self.stopping = False
        self.metrics_port = 0

    def request_stop(self, *_args: object) -> None:
        """The first SIGTERM/SIGINT drains (delivers what was leased and generated, then stops). A second one
        stops now, from wherever the loop is waiting: the user will not wait for a learner that may be gone,
        and nothing is lost, since the learner re-queues a lease whose rollouts never arrive."""
        if self.stopping:
            raise StopActor("a second stop signal: not waiting to deliver what is in flight")
        self.stopping = True

    def run(self) -> None:
        """Work until Shutdown or a signal; reconnect with backoff whenever the learner goes away."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        metrics_server = serve_actor_metrics(self.metrics, self.cfg.metrics)
        self.metrics_port = metrics_server.port if metrics_server is not None else 0
        backoff = 0.2
        late: Optional[m.Welcome] = None  # the answer to a Hello that came while we backed off
        try:
            while not self.stopping:
                try:
                    self._session(late)
                except LearnerUnavailable as exc:
                    log.warning("learner unavailable (%s); retrying in %.1fs", shown(exc), backoff)
                    self.metrics.reconnects.inc()
                    late = self.link.await_late_welcome(backoff, give_up=lambda: self.stopping)
                    backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
                except StopActor as exc:
                    log.info("actor %s stopping: %s", self.actor_id, shown(exc))
                    if exc.notice:
                        self.link.answer_shutdown(self.weights.loaded)
                    return
                else:
                    backoff = 0.2
        finally:
            log.info("actor %s rolling batch: %s", self.actor_id, self.stream.summary())
            self.link.shut()
            self.rewards.close()
            self.episodes.close()
            if metrics_server is not None:
                metrics_server.close()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, seconds))

    def connect(self) -> m.Welcome:
        """Open the request socket and register with the learner, naming the leases still held."""
        hello = m.Hello(
            # Escaped: the learner takes printable ASCII only, and a hostname may hold anything.
            actor_id=self.actor_id, host=shown(socket.gethostname())[:256], backend=str(mx.default_device()),
            versions={"mlx": mlx_version(), "python": platform.python_version()}, metrics_port=self.metrics_port,
            holding=self.inflight.holding(),
        )
        # Asked to stop with nothing to deliver: no reason to wait for a learner that may never answer.
        return self.link.open(hello, give_up=lambda: self.stopping and self.inflight.drained)

    def _session(self, welcome: Optional[m.Welcome] = None) -> None:
        """One registration's life: `welcome` is a late answer to the last Hello, else we say Hello now."""
        welcome = welcome or self.connect()
        self._adopt(welcome)
        self.link.listen(welcome.pub_address)
        self.inflight.new_connection()
        if self.inflight.submitted is not None:
            # Unacknowledged after a lost answer or a reconnect: resend it.
            self.metrics.submit_retries.inc()
            self._on_answer(self.link.request(self.inflight.submitted, m.Ack))
        self._sync_weights()
        # On SIGTERM, finish delivering what was leased and generated (drain), then stop.
        while not (self.stopping and self.inflight.drained):
            self._work_once()
        raise StopActor("signal")

    # ------------------------------------------------------------------ the learner's run and version

    def _adopt(self, welcome: m.Welcome) -> None:
        """Admit the learner's run; load its model once (same path, digest, adapters and dtype = same model)."""
        plan = admit(welcome, self.cfg.model_dirs, self.model_key)
        self.rewards.start(plan_rewards(welcome.reward, self.cfg.reward_module, self.cfg.model_dirs))
        self.episodes.start(welcome.env, self.cfg.model_dirs, self.cfg.env_concurrency)
        if plan is not None:
            self.stream.reset()  # its sequences decode on the model being replaced
            self.policy = load_policy(plan.path, lora=plan.lora, dtype=plan.dtype)
            # MLX's CPU exp is scalar on x86: decoding takes the native one (the sampler follows the same switch)
            native.use(self.cfg.native_exp)
            use_native_decoding(self.policy.model, self.cfg.native_exp)
            if native.active():
                log.info("actor %s decodes through the native exp (%s)", self.actor_id, native.vector_exp_module()[1])
            self.model_key = plan.key
            self.weights.forget()
        previous = self.welcome
        if previous is not None and (previous.run_id, previous.incarnation) != (welcome.run_id, welcome.incarnation):
            self._forget_previous_learner(previous, welcome)
        self.welcome = welcome
        self.weights.newest = welcome.policy_version
        log.info("actor %s joined run %s (policy v%d)", self.actor_id, shown(welcome.run_id), welcome.policy_version)

    def _forget_previous_learner(self, previous: m.Welcome, welcome: m.Welcome) -> None:
        """Another run, or this run resumed from a checkpoint, possibly at an older version.

        Our version number may name other weights in the new life, so reload its
        policy. Work in hand is kept for the same run: the learner judges it
        (stale if sampled past its checkpoint), and a lease it restored is still
        good to generate. Another run's leases mean nothing there.
        """
        log.warning("learner restarted (run %s incarnation %s -> run %s incarnation %s, policy v%d -> v%d); "
                    "reloading weights", previous.run_id, previous.incarnation, welcome.run_id, welcome.incarnation,
                    self.weights.loaded, welcome.policy_version)
        if previous.run_id != welcome.run_id:
            self.inflight.forget()
            self.stream.reset()
        self.weights.forget()

    def _on_notice(self, notice: Notice) -> None:
        """Track the learner's version exactly, backwards too; a new learner life means register again."""
        if self.welcome is not None and notice.incarnation and notice.incarnation != self.welcome.incarnation:
            raise LearnerUnavailable(f"the learner restarted (incarnation {notice.incarnation})")
        self.weights.follow(notice.version if isinstance(notice, m.PolicyUpdated) else notice.policy_version)

    def _resend_when_busy(self) -> None:
        """Send the unanswered submission again, a little later (the learner answers in order: BUSY is its)."""
        if self.inflight.submitted is None:
            return
        self.metrics.submit_retries.inc()
        self._sleep(BUSY_RESEND_SECONDS)
        self.link.send(self.inflight.submitted)

    def _sync_weights(self) -> None:
        """Load the newest published snapshot the learner announced (if it is not loaded yet)."""
        assert self.policy is not None  # _adopt loaded it
        self.weights.sync(self.link, self.policy.model)

    def _on_answer(self, reply: Answer) -> None:
        """Book the answer to a pipelined request: a lease to generate next, or a submission's Ack."""
        if isinstance(reply, m.Lease):
            self.inflight.book_lease(reply)
            return
        if isinstance(reply, m.ErrorReply):  # BUSY: the learner's verifier had no room for our submission
            self._resend_when_busy()
            return
        answered = self.inflight.pair_ack(reply)
        self.metrics.acks.labels(status=reply.status).inc()
        if reply.status == "invalid":
            log.error("learner rejected lease %s: %s", shown(answered.lease_id if answered else "?"), shown(reply.reason))

    # ------------------------------------------------------------------ work

    def _work_once(self) -> None:
        """One turn: follow the learner's version (only while nothing decodes), then work."""
        self.link.notices.poll()
        if self.weights.behind and self.stream.idle:
            self._sync_weights()
        welcome, policy = self.welcome, self.policy
        assert welcome is not None and policy is not None  # _adopt set both
        if welcome.env is not None:  # episodes keep their own path: a lease at a time (actor/episodes.py)
            self.one_lease.turn()
            return
        self.stream.turn(Turn(welcome, policy, self.weights.loaded, self.weights.newest, self.stopping))

    def _rollout(self, lease: m.Lease) -> m.Rollouts:
        """Generate the lease's groups under the loaded snapshot and score them (an episode lease, or an eval
        lease run alone)."""
        welcome, policy = self.welcome, self.policy
        assert welcome is not None and policy is not None  # _adopt set both before any lease
        settings = wire.sampling_settings(welcome.generation, policy.tokenizer.eos_token_ids, lease.eval)
        version, incarnation = self.weights.loaded, welcome.incarnation
        mx.reset_peak_memory()  # the gauge then shows this lease's peak, not the process's
        started = time.perf_counter()

        def beat() -> None:  # between decoding steps, so a long lease does not look like a dead actor
            self.link.heartbeat(self.weights.loaded, welcome.heartbeat_seconds)

        if welcome.env is not None:  # every prompt is an episode (actor/episodes.py), environment steps included
            scored, unscored = self.episodes.rollout(lease, welcome, policy, settings, self.rewards, self.metrics, beat)
            self.metrics.generation_seconds.observe(time.perf_counter() - started)
        else:
            groups = generate_groups(policy.model, wire.lease_prompts(lease), settings, on_step=beat)
            self.metrics.generation_seconds.observe(time.perf_counter() - started)
            scored, unscored = self.rewards.score(lease.prompts, groups, policy.tokenizer, self.metrics)
        self.metrics.peak_memory.set(mx.get_peak_memory())
        return m.Rollouts(lease_id=lease.lease_id, policy_version=version, incarnation=incarnation, groups=scored,
                          unscored=unscored)

