"""The actor's event loop: register, sync weights, lease, generate, score, submit.

All of the actor's socket work happens here. Generation and scoring are plain
function calls (`rollout.generate_groups`, `tasks.score_completion`). Actors are
stateless: anything lost with an actor is re-queued by the learner's leases.

Requests are pipelined on the one DEALER socket, so the network never idles the
model: the next lease is asked for before the current one is generated, and a
submission is sent without waiting for its Ack, which is read while the next
lease generates. The learner answers in order; at most one lease request and
one submission are ever unanswered.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import signal
import socket
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar
from urllib.parse import urlparse

import mlx.core as mx
import numpy as np

from grpo_fleet.actor.rollout import (
    SamplingSettings,
    TruncatedSamplingError,
    completion_text,
    generate_groups,
    refuse_truncated_sampling,
)
from grpo_fleet.config import ActorConfig, LoraConfig
from grpo_fleet.metrics import actor_metrics, serve_metrics
from grpo_fleet.model import Policy, load_policy, load_weight_blob, model_digest
from grpo_fleet.realshape import local_copy
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import Limits, ProtocolError
from grpo_fleet.protocol.auth import load_keypair
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.sockets import dealer_socket, make_context, recv_message, recv_with_raw, send_message, sub_socket
from grpo_fleet.protocol.weights import ChunkAssembler, WeightsMismatch
from grpo_fleet.tasks import UnknownRewardError, score_completion, validate_rewards

log = logging.getLogger("grpo_fleet.actor")
Reply = TypeVar("Reply")
MAX_BACKOFF_SECONDS = 10.0
# Weight chunks requested ahead of the one being hashed (ZeroMQ guide's credit-based transfer).
CREDIT_WINDOW = 8


class LearnerUnavailable(Exception):
    """No answer within the timeout, or the learner forgot us: register again."""


class StopActor(Exception):
    """The learner said Shutdown, or we were asked to stop."""


class ActorRefused(Exception):
    """The learner asked for something this actor will not do (unknown reward, model outside allowed dirs)."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_path_allowed(path: str, model_dirs: list[str]) -> bool:
    """Hub ids are fine; a local path must resolve inside an allowed directory (cwd by default)."""
    local = Path(path).expanduser()
    if HUB_ID.match(path) and not local.exists():
        return True
    resolved = local.resolve()
    roots = [Path(d).expanduser().resolve() for d in (model_dirs or [os.getcwd()])]
    return any(resolved == root or root in resolved.parents for root in roots)


def default_actor_id() -> str:
    """host-pid, the hostname cut down to the characters the learner accepts in an actor id."""
    host = re.sub(f"[^{m.ACTOR_ID_CHARS}]", "-", socket.gethostname()).lstrip("._:@+-") or "actor"
    return f"{host[:100]}-{os.getpid()}"


class ActorWorker:
    """One actor process."""

    def __init__(self, cfg: ActorConfig) -> None:
        self.cfg = cfg
        self.actor_id = cfg.actor_id or default_actor_id()
        self.metrics = actor_metrics()
        # The learner is trusted more than actors are: allow large weight blobs.
        self.limits = Limits(max_message_bytes=1 << 30, max_bin_len=1 << 30)
        self.ctx = make_context()
        self.policy: Optional[Policy] = None
        self.model_key: Optional[tuple] = None
        self.version = -1
        self.newest_version = -1
        self.welcome: Optional[m.Welcome] = None
        self.pending: Optional[m.Rollouts] = None  # sent, Ack not yet read
        self.next_lease: Optional[m.Lease] = None  # answered, not yet generated
        self.lease_requested = False  # a LeaseRequest is unanswered
        self.stopping = False
        self._dealer = None
        self._sub = None
        self._last_heartbeat = 0.0
        self.metrics_port = 0
        self.curve = self._load_curve(cfg)

    @staticmethod
    def _load_curve(cfg: ActorConfig) -> Optional[tuple]:
        """(own keypair, learner public key) when CURVE is configured."""
        if not cfg.key_file and not cfg.learner_key_file:
            return None
        if not (cfg.key_file and cfg.learner_key_file):
            raise ActorRefused("CURVE needs both --key (this actor's secret key) and --learner-key (learner.key)")
        keypair = load_keypair(cfg.key_file)
        if keypair.secret is None:
            raise ActorRefused(f"{cfg.key_file} holds no secret key; pass the NAME.key_secret file")
        return keypair, load_keypair(cfg.learner_key_file).public

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self, *_args: object) -> None:
        self.stopping = True

    def run(self) -> None:
        """Work until Shutdown or a signal; reconnect with backoff whenever the learner goes away."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.metrics_port = self._serve_metrics()
        backoff = 0.2
        try:
            while not self.stopping:
                try:
                    self._session()
                except LearnerUnavailable as exc:
                    log.warning("learner unavailable (%s); retrying in %.1fs", shown(exc), backoff)
                    self.metrics.reconnects.inc()
                    self._sleep(backoff)
                    backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
                except StopActor as exc:
                    log.info("actor %s stopping: %s", self.actor_id, shown(exc))
                    return
                else:
                    backoff = 0.2
        finally:
            self._close_sockets()
            self.ctx.term()

    def _serve_metrics(self) -> int:
        """Serve /metrics; if the port is taken (a second actor on this Mac), take any free one.

        The learner learns the real port from Hello, so service discovery still finds it.
        """
        host, port = self.cfg.metrics.host, self.cfg.metrics.port
        try:
            return serve_metrics(self.metrics.registry, host, port) or 0
        except OSError as exc:
            log.warning("metrics port %d unavailable (%s); using a free port instead", port, exc)
            return serve_metrics(self.metrics.registry, host, 0, any_port=True) or 0

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, seconds))

    def _close_sockets(self) -> None:
        for sock in (self._dealer, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._dealer = self._sub = None

    def connect(self) -> m.Welcome:
        """Open the request socket and register with the learner."""
        self._close_sockets()
        self._dealer = dealer_socket(
            self.ctx, self.cfg.connect, identity=self.actor_id.encode(),
            max_message_bytes=self.limits.max_message_bytes, curve=self.curve,
        )
        hello = m.Hello(
            # Escaped: the learner takes printable ASCII only, and a hostname may hold anything.
            actor_id=self.actor_id, host=shown(socket.gethostname())[:256], backend=str(mx.default_device()),
            versions={"mlx": mx.__version__, "python": platform.python_version()}, metrics_port=self.metrics_port,
            holding=[work.lease_id for work in (self.pending, self.next_lease) if work is not None and work.lease_id],
        )
        return self._request(hello, m.Welcome)

    def _session(self) -> None:
        welcome = self.connect()
        self._adopt(welcome)
        self._sub = sub_socket(self.ctx, self._notice_address(welcome.pub_address), curve=self.curve)
        # A new socket: answers to the old one's requests are gone.
        self.lease_requested = False
        if self.pending is not None:
            # Unacknowledged after a lost answer or a reconnect: resend it.
            self.metrics.submit_retries.inc()
            self._on_reply(self._request(self.pending, m.Ack))
        self._sync_weights()
        # On SIGTERM, finish delivering what was leased and generated (drain), then stop.
        while not (self.stopping and self._drained()):
            self._work_once()
        raise StopActor("signal")

    def _drained(self) -> bool:
        return self.pending is None and self.next_lease is None and not self.lease_requested

    def _notice_address(self, pub_address: Optional[str]) -> str:
        # A learner bound to a wildcard advertises it; dial the host we reached it on.
        parsed = urlparse(pub_address or "")
        host = parsed.hostname
        if host in (None, "0.0.0.0", "*", "::"):
            host = urlparse(self.cfg.connect).hostname
        return f"tcp://{host}:{parsed.port}"

    # ------------------------------------------------------------------ requests

    def _request(self, msg: object, expected: type[Reply]) -> Reply:
        """Send and wait for a reply of the expected type, ignoring stray replies."""
        send_message(self._dealer, msg)
        deadline = time.monotonic() + self.cfg.request_timeout
        while not isinstance(reply := self._next_reply(deadline, type(msg).__name__), expected):
            self._on_stray_reply(reply)
        return reply

    def _next_reply(self, deadline: float, what: str) -> Optional[object]:
        """The learner's next answer, or None if none came within half a second; past `deadline` it is gone."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LearnerUnavailable(f"no reply to {what}")
        try:
            return recv_message(self._dealer, timeout_s=min(remaining, 0.5), limits=self.limits)
        except ProtocolError as exc:
            log.warning("bad reply from learner: %s", shown(exc))
            return None

    def _on_stray_reply(self, reply: object) -> None:
        """Anything but the awaited answer: a pipelined answer, stop, re-register, or keep listening."""
        if isinstance(reply, (m.Ack, m.Lease)):
            self._on_reply(reply)
            return
        if isinstance(reply, m.Shutdown):
            raise StopActor(f"learner shut down ({reply.reason})")
        if isinstance(reply, m.ErrorReply):
            raise LearnerUnavailable(f"learner error {reply.reason}: {reply.detail}")
        self._check_notices()

    def _on_reply(self, reply: object) -> None:
        """Book the answer to a pipelined request: a lease to generate next, or a submission's Ack."""
        if isinstance(reply, m.Lease):
            self.next_lease, self.lease_requested = reply, False
        elif isinstance(reply, m.Ack):
            self.metrics.acks.labels(status=reply.status).inc()
            if reply.status == "invalid":
                log.error("learner rejected lease %s: %s", shown(self.pending.lease_id if self.pending else "?"), shown(reply.reason))
            self.pending = None

    def _await(self, settled: Callable[[], bool]) -> None:
        """Read answers until `settled()`; no answer within the request timeout means the learner is gone."""
        deadline = time.monotonic() + self.cfg.request_timeout
        while not settled():
            reply = self._next_reply(deadline, "a pipelined request")
            if reply is not None:
                self._on_stray_reply(reply)

    def _check_notices(self) -> None:
        """Drain the PUB channel: remember the newest policy version; Shutdown stops us.

        It never sends a request itself: it runs while another request waits for
        its reply, and a nested request would swallow that reply.
        """
        while self._sub is not None:
            try:
                notice = recv_message(self._sub, timeout_s=0, limits=self.limits)
            except ProtocolError:
                continue
            if notice is None:
                break
            if isinstance(notice, m.Shutdown):
                raise StopActor(f"learner shut down ({notice.reason})")
            if isinstance(notice, (m.PolicyUpdated, m.Heartbeat)):
                self._follow(notice)

    def _follow(self, notice: m.PolicyUpdated | m.Heartbeat) -> None:
        """Track the learner's version exactly, backwards too; a new learner life means register again."""
        if self.welcome is not None and notice.incarnation and notice.incarnation != self.welcome.incarnation:
            raise LearnerUnavailable(f"the learner restarted (incarnation {notice.incarnation})")
        self.newest_version = notice.version if isinstance(notice, m.PolicyUpdated) else notice.policy_version
        self.metrics.policy_lag.set(abs(self.newest_version - self.version))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.welcome and now - self._last_heartbeat >= self.welcome.heartbeat_seconds:
            self._last_heartbeat = now
            send_message(self._dealer, m.Heartbeat(actor_id=self.actor_id, policy_version=max(self.version, 0), sent_at=time.time()))

    # ------------------------------------------------------------------ model and weights

    def _adopt(self, welcome: m.Welcome) -> None:
        """Load the learner's model once (same path, digest and adapters = same model)."""
        try:
            validate_rewards(welcome.reward.names, welcome.reward.weights)
        except UnknownRewardError as exc:
            raise ActorRefused(f"the learner asks for a reward this actor does not have: {exc}") from exc
        try:
            refuse_truncated_sampling(welcome.generation.top_p)
        except TruncatedSamplingError as exc:
            raise ActorRefused(str(exc)) from exc
        key = (welcome.model.path, welcome.model.digest, str(welcome.model.lora), welcome.model.dtype)
        if key != self.model_key:
            path = self._local_model_path(welcome.model.path)
            if model_digest(path) != welcome.model.digest:
                raise ActorRefused(f"local copy of {welcome.model.path} differs from the learner's (digest mismatch)")
            lora = LoraConfig(**welcome.model.lora) if welcome.model.lora else None
            self.policy = load_policy(path, lora=lora, dtype=welcome.model.dtype)
            self.model_key = key
            self.version = -1
        previous = self.welcome
        if previous is not None and (previous.run_id, previous.incarnation) != (welcome.run_id, welcome.incarnation):
            self._forget_previous_learner(previous, welcome)
        self.welcome = welcome
        self.newest_version = welcome.policy_version
        log.info("actor %s joined run %s (policy v%d)", self.actor_id, shown(welcome.run_id), welcome.policy_version)

    def _local_model_path(self, path: str) -> str:
        """Where to load the learner's model from: a real-shape model is (re)built in this machine's
        own cache, which needs no --model-dir; any other local path must be allowed."""
        built = local_copy(path)
        if built is not None:
            return str(built)
        if not model_path_allowed(path, self.cfg.model_dirs):
            raise ActorRefused(
                f"model path {path!r} is outside the allowed directories "
                f"{self.cfg.model_dirs or [os.getcwd()]}; pass --model-dir to allow it"
            )
        return path

    def _forget_previous_learner(self, previous: m.Welcome, welcome: m.Welcome) -> None:
        """Another run, or this run resumed from a checkpoint, possibly at an older version.

        Our version number may name other weights in the new life, so reload its
        policy. Work in hand is kept for the same run: the learner judges it
        (stale if sampled past its checkpoint), and a lease it restored is still
        good to generate. Another run's leases mean nothing there.
        """
        log.warning("learner restarted (run %s incarnation %s -> run %s incarnation %s, policy v%d -> v%d); "
                    "reloading weights", previous.run_id, previous.incarnation, welcome.run_id, welcome.incarnation,
                    self.version, welcome.policy_version)
        if previous.run_id != welcome.run_id:
            self.pending, self.next_lease = None, None
        self.version = -1

    def _sync_weights(self) -> None:
        """Fetch the newest snapshot in chunks and swap it in only if its digest checks out."""
        started = time.perf_counter()
        try:
            version, blob, digest = self.fetch_weights(max(self.newest_version, 0))
        except WeightsMismatch as exc:
            self.metrics.weight_syncs.labels(outcome="rejected").inc()
            log.error("refusing weights: %s; keeping v%d", shown(exc), self.version)
            return
        if version == self.version:
            return
        try:
            load_weight_blob(self.policy.model, blob, digest)
        except ValueError as exc:
            self.metrics.weight_syncs.labels(outcome="rejected").inc()
            log.error("refusing weights v%d: %s", version, shown(exc))
            return
        self.version = version
        self.metrics.weight_syncs.labels(outcome="loaded").inc()
        self.metrics.weight_fetch_seconds.observe(time.perf_counter() - started)
        self.metrics.policy_version.set(self.version)
        self.metrics.policy_lag.set(abs(self.newest_version - self.version))

    def fetch_weights(self, version: int) -> tuple[int, bytearray, str]:
        """Pull one version's blob with up to CREDIT_WINDOW chunk requests in flight."""
        send_message(self._dealer, m.GetWeights(version=version, offset=0, length=0))
        first, payload = self._await_chunk(offset=0)
        assembler = ChunkAssembler.from_first(first, chunk_bytes=max(first.length, 1))
        assembler.next_request()  # the first chunk is already here
        assembler.add(first, payload)
        in_flight = 0
        while not assembler.complete:
            while in_flight < CREDIT_WINDOW and (request := assembler.next_request()) is not None:
                send_message(self._dealer, request)
                in_flight += 1
            header, payload = self._await_chunk(offset=assembler.received)
            in_flight -= 1
            if not assembler.belongs(header):
                raise WeightsMismatch(f"learner switched to v{header.version} mid-transfer")
            assembler.add(header, payload)
        return assembler.version, assembler.blob(), assembler.digest

    def _await_chunk(self, offset: int) -> tuple[m.WeightsChunk, memoryview]:
        """The chunk starting at `offset`; leftovers of an abandoned transfer are skipped."""
        deadline = time.monotonic() + self.cfg.request_timeout
        while time.monotonic() < deadline:
            try:
                received = recv_with_raw(self._dealer, timeout_s=0.5, limits=self.limits)
            except ProtocolError as exc:
                log.warning("bad reply from learner: %s", shown(exc))
                continue
            if received is None:
                continue
            msg, raw = received
            if isinstance(msg, m.WeightsChunk):
                if raw is not None and msg.offset == offset:
                    return msg, raw
                continue
            self._on_stray_reply(msg)
        raise LearnerUnavailable("no weight chunk")

    # ------------------------------------------------------------------ work

    def _work_once(self) -> None:
        self._check_notices()
        if self.newest_version != self.version:
            self._sync_weights()
        lease = self._take_lease()
        if lease is None:
            return
        if not self.stopping:
            self._request_lease()  # answered while this lease generates
        rollouts = self._rollout(lease)
        self._await(lambda: self.pending is None)  # the previous Ack is normally long in
        self.pending = rollouts
        send_message(self._dealer, rollouts)

    def _request_lease(self) -> None:
        send_message(self._dealer, m.LeaseRequest(max_groups=self.cfg.max_groups))
        self.lease_requested = True

    def _take_lease(self) -> Optional[m.Lease]:
        """The lease to generate now: the prefetched one, or one asked for now; None if there is none."""
        if self.next_lease is None and not self.lease_requested:
            if self.stopping:
                self._await(lambda: self.pending is None)
                return None
            self._request_lease()
        self._await(lambda: self.next_lease is not None)
        lease, self.next_lease = self.next_lease, None
        if not lease.prompts:
            self._sleep(lease.retry_after)
            return None
        return lease

    def _rollout(self, lease: m.Lease) -> m.Rollouts:
        welcome, policy = self.welcome, self.policy
        gen = welcome.generation
        settings = SamplingSettings(
            group_size=gen.group_size, max_tokens=gen.max_tokens, temperature=gen.temperature,
            top_p=gen.top_p, stop_token_ids=sorted(policy.tokenizer.eos_token_ids),
        )
        version, incarnation = self.version, welcome.incarnation
        mx.reset_peak_memory()  # the gauge then shows this lease's peak, not the process's
        started = time.perf_counter()
        prompts = [item.prompt_tokens.to_numpy().tolist() for item in lease.prompts]
        groups = generate_groups(policy.model, prompts, settings, on_step=self._heartbeat)
        self.metrics.generation_seconds.observe(time.perf_counter() - started)
        self.metrics.peak_memory.set(mx.get_peak_memory())
        results = [self._score_group(item, completions) for item, completions in zip(lease.prompts, groups)]
        return m.Rollouts(lease_id=lease.lease_id, policy_version=version, incarnation=incarnation, groups=results)

    def _score_group(self, item: m.PromptItem, completions: list) -> m.GroupResult:
        reward = self.welcome.reward
        eos = set(self.policy.tokenizer.eos_token_ids)
        wire = []
        for completion in completions:
            text = completion_text(self.policy.tokenizer, completion, eos)
            score = score_completion(reward.names, reward.weights, text, item.fields)
            self.metrics.reward.observe(score)
            self.metrics.tokens_generated.inc(len(completion.tokens))
            wire.append(m.Completion(
                tokens=m.Tensor.from_numpy(np.asarray(completion.tokens, dtype=np.int32)),
                logprobs=m.Tensor.from_numpy(np.asarray(completion.logprobs, dtype=np.float32)),
                reward=float(score),
                finish_reason=completion.finish_reason,
            ))
        self.metrics.groups_generated.inc()
        return m.GroupResult(group_id=item.group_id, completions=wire)

