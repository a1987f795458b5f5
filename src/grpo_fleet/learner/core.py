"""The learner's state and its answers to each message, without sockets.

`server.py` owns the ZeroMQ loop and calls `handle()`; everything here takes and
returns plain objects, so it can be tested without a network.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.bans import Bans, peer_key
from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord, build_train_batch
from grpo_fleet.learner.intake import suspect_groups
from grpo_fleet.learner.fleet import ActorInfo, TokenRate, actor_from_hello, sd_groups
from grpo_fleet.learner.pacing import MovingAverage, lease_size, lease_target_seconds
from grpo_fleet.learner.scheduler import PromptScheduler
from grpo_fleet.learner.trainer import StepStats, Trainer
from grpo_fleet.metrics import LearnerMetrics
from grpo_fleet.learner.persistence import Persistence
from grpo_fleet.model import Policy, trainable_weights, weights_to_bytes
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.weights import Snapshot
from grpo_fleet.tasks import Task

log = logging.getLogger("grpo_fleet.learner")
# Stored answers kept for replays (at-least-once actors resend after a reconnect).
ACK_CACHE_SIZE = 4096
# Bounds on how long an actor refused a lease waits before asking again.
MIN_RETRY_SECONDS, MAX_RETRY_SECONDS = 0.005, 0.2


class Learner(Persistence):
    """Single source of truth for the run: leases, accepted groups, steps and versions."""

    def __init__(
        self,
        cfg: RunConfig,
        policy: Policy,
        trainer: Trainer,
        task: Task,
        prompt_tokens: list[np.ndarray],
        model_digest: str,
        metrics: LearnerMetrics,
        run_dir: Path,
        pub_address: Optional[str] = None,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.trainer = trainer
        self.task = task
        self.prompt_tokens = prompt_tokens
        self.model_digest = model_digest
        self.metrics = metrics
        self.run_dir = run_dir
        self.pub_address = pub_address
        self.run_id = uuid.uuid4().hex[:12]
        # This life of the learner process; see m.Incarnation. Versions up to
        # history_version were published by earlier lives too, with the same weights.
        self.incarnation = uuid.uuid4().hex[:12]
        self.history_version = 0
        self.scheduler = PromptScheduler(
            len(prompt_tokens), seed=cfg.train.seed, lease_seconds=cfg.server.lease_seconds
        )
        # The I/O thread (handle) and the training thread (train_step) share this state.
        self.lock = threading.RLock()
        # The training thread sleeps on this until a batch is buffered.
        self.batch_ready = threading.Condition(self.lock)
        self.actors: dict[bytes, ActorInfo] = {}
        self.rate = TokenRate()
        self.groups_accepted = 0
        self.sd_snapshot: list[dict] = []
        self.bans = Bans(cfg.server.max_violations, cfg.server.ban_seconds)
        self.acks: dict[str, m.Ack] = {}
        self.buffer: list[AcceptedGroup] = []
        self.step = 0
        self.version = 0
        self.accepted_since_step = 0
        self.zero_variance_since_step = 0
        self.started = time.monotonic()
        self.step_interval = MovingAverage()
        self._last_step_at: Optional[float] = None
        self.snapshots: dict[int, Snapshot] = {}
        self.snapshot: Snapshot
        self._make_snapshot()
        self._metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._ledger_file = open(run_dir / "ledger.jsonl", "a", buffering=1)

    # ------------------------------------------------------------------ snapshots

    def _serialize(self, version: int) -> Snapshot:
        """Serialize the trainable weights once per version; every actor gets these same bytes."""
        blob = weights_to_bytes(trainable_weights(self.policy.model))
        return Snapshot(version=version, blob=blob, digest=m.blob_digest(blob))

    def _install_snapshot(self, snapshot: Snapshot) -> None:
        # Keep the previous version too, so an actor mid-transfer can finish it.
        self.snapshots = {v: s for v, s in self.snapshots.items() if v == snapshot.version - 1}
        self.snapshots[snapshot.version] = snapshot
        self.snapshot = snapshot

    def _make_snapshot(self) -> None:
        """Serialize the current weights as the current version (start-up and resume)."""
        self._install_snapshot(self._serialize(self.version))

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.train.steps

    # ------------------------------------------------------------------ dispatch

    def handle(
        self, identity: bytes, msg: object, principal: Optional[str] = None, peer_address: str = ""
    ) -> Optional[object]:
        """Answer one decoded message; serialized against the training thread's bookkeeping."""
        with self.lock:
            return self._handle(identity, msg, principal, peer_address)

    def _handle(
        self, identity: bytes, msg: object, principal: Optional[str], peer_address: str
    ) -> Optional[object]:
        """Answer one decoded message from `identity` (None = no reply).

        `principal` is the authenticated CURVE key; leases are bound to it, so a
        peer reusing another actor's routing id cannot act for it.
        """
        owner = peer_key(identity, principal)
        if isinstance(msg, m.Hello):
            return self._on_hello(identity, owner, msg, peer_address)
        if isinstance(msg, m.StatusRequest):
            return self.status()
        actor = self.actors.get(identity)
        if actor is None or actor.principal != owner:
            # Not a violation: every honest actor sends a few of these to a
            # restarted learner before its next Hello, and answering is cheap.
            self.metrics.protocol_errors.labels(reason="not_registered").inc()
            return m.ErrorReply(reason="not_registered", detail="send Hello first")
        actor.last_seen = time.monotonic()
        if isinstance(msg, m.Heartbeat):
            actor.policy_version = msg.policy_version
            return m.Heartbeat(actor_id=actor.actor_id, policy_version=self.version, sent_at=time.time(),
                               incarnation=self.incarnation)
        if isinstance(msg, m.GetWeights):
            return self._on_get_weights(msg)
        if isinstance(msg, m.LeaseRequest):
            return self._on_lease_request(identity, msg)
        if isinstance(msg, m.Rollouts):
            return self._on_rollouts(identity, msg)
        self.metrics.protocol_errors.labels(reason="unexpected_type").inc()
        self.record_violation(owner, "unexpected_type")
        return m.ErrorReply(reason="unexpected_type", detail=f"{type(msg).__name__} is not a request")

    def _on_hello(self, identity: bytes, owner: str, msg: m.Hello, peer_address: str) -> m.Welcome | m.ErrorReply:
        if identity not in self.actors and len(self.actors) >= self.cfg.server.max_actors:
            # Throwaway identities must not grow the registry; a real actor retries with backoff.
            self.metrics.protocol_errors.labels(reason="too_many_actors").inc()
            return m.ErrorReply(reason="too_many_actors", detail=f"{len(self.actors)} actors registered "
                                "(server.max_actors); retry when one leaves")
        self.actors[identity] = actor_from_hello(msg, owner, peer_address)
        log.info("actor %s joined from %s (%s)", shown(msg.actor_id), shown(msg.host), shown(msg.backend))
        # A restarted actor, or one reconnecting to a resumed learner, will never
        # return the leases it does not name; unless its key has another live
        # session (one key on two Macs), hand them out again now.
        if sum(info.principal == owner for info in self.actors.values()) == 1:
            released = self.scheduler.release_actor(owner, keep=frozenset(msg.holding))
            if released:
                log.info("actor %s came back without %d of its leases; re-queued them", shown(msg.actor_id), released)
        self.metrics.actors_connected.set(len(self.actors))
        return self.welcome(msg.actor_id)

    def welcome(self, actor_id: str) -> m.Welcome:
        cfg = self.cfg
        lora = cfg.lora.model_dump() if self.policy.lora is not None else None
        return m.Welcome(
            run_id=self.run_id,
            actor_id=actor_id,
            model=m.ModelRef(
                path=self.policy.path,
                digest=self.model_digest,
                lora=lora,
                dtype=cfg.model.dtype,
                chat_template=cfg.task.chat_template,
                system_prompt=cfg.task.system_prompt,
            ),
            generation=m.GenerationParams(**cfg.generation.model_dump()),
            reward=m.RewardSpec(names=list(self.task.reward_names), weights=[float(w) for w in self.task.reward_weights]),
            policy_version=self.version,
            heartbeat_seconds=cfg.server.heartbeat_seconds,
            pub_address=self.pub_address,
            vocab_size=self.policy.vocab_size,
            incarnation=self.incarnation,
        )

    def _on_get_weights(self, msg: m.GetWeights) -> tuple[m.WeightsChunk, memoryview]:
        """One chunk of the requested version, or of the current one if that version is gone."""
        snap = self.snapshots.get(msg.version, self.snapshot)
        header, raw = snap.chunk(msg.offset, msg.length, self.cfg.server.weight_chunk_bytes)
        self.metrics.weight_bytes_served.inc(header.length)
        return header, raw

    # ------------------------------------------------------------------ leases

    def _lease_capacity(self) -> int:
        # Bound what is in flight so rollouts stay within max_staleness of the policy.
        limit = 2 * self.cfg.grpo.groups_per_step
        return max(0, limit - self.scheduler.outstanding_groups - len(self.buffer))

    def _on_lease_request(self, identity: bytes, msg: m.LeaseRequest) -> m.Lease:
        actor = self.actors[identity]
        limit = min(self.cfg.server.max_groups_per_lease, self._lease_capacity())
        count = lease_size(msg.max_groups, limit, actor.groups_per_second.value, self._lease_target())
        lease = self.scheduler.issue(actor.principal, count) if count and not self.done else None
        if lease is None:
            return m.Lease(lease_id="", deadline_seconds=0.0, policy_version=self.version, prompts=[],
                           retry_after=self._retry_after())
        self.metrics.leases_issued.inc()
        self.metrics.lease_groups.observe(len(lease.tickets))
        self.metrics.leases_outstanding.set(len(self.scheduler.leases))
        prompts = [self._prompt_item(t.group_id, t.prompt_index) for t in lease.tickets.values()]
        return m.Lease(
            lease_id=lease.lease_id,
            deadline_seconds=self.cfg.server.lease_seconds,
            policy_version=self.version,
            prompts=prompts,
        )

    def _lease_target(self) -> Optional[float]:
        server = self.cfg.server
        return lease_target_seconds(server.lease_target_seconds, self.cfg.grpo.max_staleness,
                                    self.step_interval.value, server.lease_seconds)

    def _retry_after(self) -> float:
        # Capacity frees when the next step takes its batch, about one step from now.
        if self.done or self.step_interval.value is None:
            return MAX_RETRY_SECONDS
        return min(MAX_RETRY_SECONDS, max(MIN_RETRY_SECONDS, 0.5 * self.step_interval.value))

    def _measure_actor(self, actor: ActorInfo, lease_id: str, groups: int) -> None:
        """Groups per second of a returned lease, for sizing the next ones.

        The clock starts when the lease was issued or when the actor's previous
        lease came back, whichever is later: actors ask for their next lease
        before generating the current one, and it waits in hand meanwhile.
        """
        lease = self.scheduler.leases.get(lease_id)
        if lease is None or not groups:
            return
        now = self.scheduler.clock()
        started = max(lease.issued_at, actor.last_return if actor.last_return is not None else lease.issued_at)
        actor.groups_per_second.add(groups / max(now - started, 1e-3))
        actor.last_return = now

    def _prompt_item(self, group_id: str, index: int) -> m.PromptItem:
        tokens = m.Tensor.from_numpy(self.prompt_tokens[index])
        return m.PromptItem(group_id=group_id, prompt_index=index, prompt_tokens=tokens, fields=self.task.fields(self.task.train[index]))

    def status(self) -> m.Status:
        """The run at a glance, for `grpo-fleet status`."""
        now = time.monotonic()
        return m.Status(
            run_id=self.run_id, step=self.step, steps_target=self.cfg.train.steps, policy_version=self.version,
            tokens_per_second=self.rate.per_second(now), groups_accepted=self.groups_accepted,
            actors=[info.status(now) for info in self.actors.values()],
        )

    def refresh_service_discovery(self, learner_target: Optional[str]) -> None:
        """Rebuild the /sd answer; done on the main thread and swapped whole, the HTTP thread only reads it."""
        with self.lock:
            self.sd_snapshot = sd_groups(learner_target, list(self.actors.values()))

    def drop_actor(self, identity: bytes) -> int:
        """Forget an actor (silent or revoked) and re-queue its leases; returns the lease count."""
        with self.lock:
            info = self.actors.pop(identity, None)
            if info is None:
                return 0
            self.metrics.actors_connected.set(len(self.actors))
            return self.scheduler.release_actor(info.principal)

    def expire_leases(self) -> int:
        """Re-queue leases past their deadline; returns how many expired."""
        with self.lock:
            expired = self.scheduler.expire()
            if expired:
                self.metrics.leases_expired.inc(len(expired))
                self.metrics.leases_outstanding.set(len(self.scheduler.leases))
            return len(expired)

    # ------------------------------------------------------------------ rollouts

    def _reject(self, identity: bytes, reason: str, detail: str = "") -> m.Ack:
        """Refuse hostile or malformed rollouts; this counts toward the peer's ban."""
        self.metrics.rejections.labels(reason=reason).inc()
        self.record_violation(self.actors[identity].principal, reason)
        return m.Ack(status="invalid", reason=reason if not detail else f"{reason}: {detail}")

    def record_violation(self, key: str, reason: str) -> None:
        """Count malformed or hostile input from a peer key (see learner/bans.py for the policy)."""
        self.metrics.violations.labels(reason=reason).inc()
        if self.bans.record(key):
            self.metrics.bans.inc()
            log.warning("peer %s banned for %.0fs after %d violations (last: %s)", key,
                        self.bans.ban_seconds, self.bans.max_violations, reason)
        self.metrics.banned_peers.set(self.bans.banned_count())

    def is_banned(self, key: str) -> bool:
        return self.bans.is_banned(key)

    def _on_rollouts(self, identity: bytes, msg: m.Rollouts) -> m.Ack:
        stored = self.acks.get(msg.lease_id)
        if stored is not None:
            return stored  # a replay: same answer, no new accounting
        if self.done:
            # The final checkpoint is written: accepting more would put groups in
            # the ledger that no checkpoint or step ever accounts for.
            return m.Ack(status="stale", reason="run_done", groups={g.group_id: "stale" for g in msg.groups})
        gen = self.cfg.generation
        reason = m.validate_rollouts(msg, group_size=gen.group_size, vocab_size=self.policy.vocab_size,
                                     max_tokens=gen.max_tokens, reward_bound=self.cfg.task.reward_bound)
        if reason is not None:
            return self._reject(identity, reason)
        known_lease = msg.lease_id in self.scheduler.leases
        owner = self.actors[identity].principal
        statuses = {g.group_id: self.scheduler.classify(owner, msg.lease_id, g.group_id) for g in msg.groups}
        bad = sorted({s for s in statuses.values() if s in ("not_your_lease", "not_leased")})
        if bad:
            return self._reject(identity, bad[0])
        self._measure_actor(self.actors[identity], msg.lease_id, len(msg.groups))
        unusable = self._unusable_version(msg)
        if unusable is not None:
            return self._store(msg.lease_id, self._stale(msg, statuses, unusable), known_lease)
        return self._store(msg.lease_id, self._accept(identity, msg, statuses), known_lease)

    def _unusable_version(self, msg: m.Rollouts) -> Optional[str]:
        """Why rollouts cannot train this policy (None = they can); none of these is the actor's fault.

        After a resume, actors may still hold versions the previous life published
        past its last checkpoint: those numbers either do not exist yet in this
        life or name other weights, so such work is stale, never a violation.
        """
        version = msg.policy_version
        if version > self.version:
            return "unpublished_version"
        if msg.incarnation != self.incarnation and version > self.history_version:
            return "previous_incarnation"
        if self.version - version > self.cfg.grpo.max_staleness:
            return "stale_version"
        return None

    def _store(self, lease_id: str, ack: m.Ack, known_lease: bool) -> m.Ack:
        # Only answers about leases that were open are worth replaying, and the
        # cache is bounded so no peer can grow it without limit.
        if known_lease:
            self.acks[lease_id] = ack
            while len(self.acks) > ACK_CACHE_SIZE:
                self.acks.pop(next(iter(self.acks)))
        self.metrics.leases_outstanding.set(len(self.scheduler.leases))
        return ack

    def _stale(self, msg: m.Rollouts, statuses: dict[str, str], reason: str) -> m.Ack:
        for group_id, status in statuses.items():
            if status == "ok":
                self.scheduler.requeue(msg.lease_id, group_id)
        self.metrics.rejections.labels(reason=reason).inc(len(msg.groups))
        return m.Ack(status="stale", reason=reason, groups={g: "stale" for g in statuses})

    def _accept(self, identity: bytes, msg: m.Rollouts, statuses: dict[str, str]) -> m.Ack:
        answer: dict[str, str] = {}
        for group in msg.groups:
            status = statuses[group.group_id]
            if status != "ok":
                self.metrics.rejections.labels(reason=status).inc()
                answer[group.group_id] = "duplicate" if status == "duplicate" else "stale"
                continue
            ticket = self.scheduler.finish(msg.lease_id, group.group_id)
            self._take_group(identity, msg.policy_version, ticket.prompt_index, group)
            answer[group.group_id] = "accepted"
        overall = "accepted" if "accepted" in answer.values() else next(iter(answer.values()))
        return m.Ack(status=overall, groups=answer)

    def _take_group(self, identity: bytes, version: int, prompt_index: int, group: m.GroupResult) -> None:
        actor = self.actors[identity]
        actor_id, owner = actor.actor_id, actor.principal
        record = AcceptedGroup(
            group_id=group.group_id,
            prompt_index=prompt_index,
            prompt_tokens=self.prompt_tokens[prompt_index],
            completions=[
                CompletionRecord(
                    tokens=c.tokens.to_numpy().astype(np.int32),
                    logprobs=c.logprobs.to_numpy().astype(np.float32),
                    reward=float(c.reward),
                    finish_reason=c.finish_reason,
                )
                for c in group.completions
            ],
            policy_version=version,
            actor_id=actor_id,
            actor_key=owner,
        )
        self._ledger_file.write(json.dumps({
            "group_id": record.group_id, "prompt_index": prompt_index, "actor_id": actor_id,
            "actor_key": owner, "policy_version": version, "step": self.step,
        }) + "\n")
        self.metrics.groups_accepted.inc()
        self.metrics.tokens_accepted.inc(record.num_tokens)
        actor.rate.add(record.num_tokens)
        actor.policy_version = max(actor.policy_version, version)
        self.rate.add(record.num_tokens)
        self.groups_accepted += 1
        self.metrics.staleness.observe(self.version - version)
        self.metrics.group_reward.observe(float(record.rewards.mean()))
        self.accepted_since_step += 1
        if record.is_informative:
            self.buffer.append(record)
            if len(self.buffer) >= self.cfg.grpo.groups_per_step:
                self.batch_ready.notify()
        else:
            self.zero_variance_since_step += 1
            self.metrics.groups_zero_variance.inc()

    # ------------------------------------------------------------------ training

    def ready_to_train(self) -> bool:
        with self.lock:
            return not self.done and len(self.buffer) >= self.cfg.grpo.groups_per_step

    def wait_for_batch(self, timeout: float) -> bool:
        """Block the training thread until a batch is buffered (or `timeout` passes)."""
        with self.batch_ready:
            return self.batch_ready.wait_for(self.ready_to_train, timeout)

    def train_step(self) -> dict:
        """One optimizer batch from the oldest informative groups; publishes when due.

        Safe to run on a training thread while another thread calls `handle()`:
        the state is locked only to take the batch and to record the result, not
        while the model trains or the new snapshot is serialized.
        """
        started = time.perf_counter()
        with self.lock:
            count = self.cfg.grpo.groups_per_step
            groups, self.buffer = self.buffer[:count], self.buffer[count:]
            trained_on = self.version
        batch = build_train_batch(groups, scale_by_std=self.cfg.grpo.scale_by_std)
        phases = {"data_prep": time.perf_counter() - started}
        stats = self.trainer.step(batch)
        self.metrics.peak_memory.set(stats.peak_memory_bytes)
        if stats.skipped is not None:
            self._blame_skipped_update(groups, stats)
        phases.update(ref_forward=stats.ref_seconds, update=stats.update_seconds)
        step = self.step + 1  # only the training thread moves the step
        snapshot = None
        if step % self.cfg.train.sync_every == 0:
            publish_started = time.perf_counter()
            snapshot = self._serialize(trained_on + 1)
            phases["publish"] = time.perf_counter() - publish_started
        with self.lock:
            record = self._record_step(step, snapshot, groups, stats, time.perf_counter() - started, trained_on, phases)
        for phase, seconds in phases.items():
            self.metrics.step_phase_seconds.labels(phase=phase).observe(seconds)
        return record

    def _blame_skipped_update(self, groups: list[AcceptedGroup], stats: StepStats) -> None:
        """A non-finite loss or gradient applied no update; count it and charge the groups that caused it.

        The step still counts (its groups are consumed) but the weights did not
        move. Groups holding values outside their float32 bounds count toward
        their actors' bans; if none does, the inputs were clean and nobody is
        blamed: the fault is the learner's numerics, and the log says so.
        """
        assert stats.skipped is not None
        self.metrics.skipped_updates.labels(reason=stats.skipped).inc()
        suspects = suspect_groups(groups, self.cfg.task.reward_bound)
        culprits = sorted({shown(g.actor_id) for g in groups if g.group_id in suspects})
        log.warning("step %d applied no update: %s (loss %s, grad norm %s); %s", self.step + 1, stats.skipped,
                    stats.loss, stats.grad_norm,
                    f"out-of-bounds values in {len(suspects)} groups from actors {', '.join(culprits)}"
                    if culprits else "every input was within bounds, so no actor is blamed")
        with self.lock:
            for group in groups:
                if group.group_id in suspects and group.actor_key:
                    self.record_violation(group.actor_key, f"poisoned_{suspects[group.group_id]}")

    def _record_step(self, step: int, snapshot: Optional[Snapshot], groups: list[AcceptedGroup], stats: StepStats,
                     seconds: float, trained_on: int, phases: dict) -> dict:
        self.step = step
        now = time.monotonic()
        if self._last_step_at is not None:
            self.step_interval.add(now - self._last_step_at)
        self._last_step_at = now
        if snapshot is not None:
            self.version = snapshot.version
            self._install_snapshot(snapshot)
            self.metrics.weight_publish_seconds.observe(phases["publish"])
            self.metrics.weight_publish_bytes.set(len(snapshot.blob))
        record = self._step_record(groups, stats, seconds, trained_on)
        self._metrics_file.write(json.dumps(record) + "\n")
        self._observe_step(record)
        if self.step % self.cfg.train.checkpoint_every == 0 or self.done:
            checkpoint_started = time.perf_counter()
            self.checkpoint()
            phases["checkpoint"] = time.perf_counter() - checkpoint_started
        record["published"] = snapshot is not None
        return record

    def _step_record(self, groups: list[AcceptedGroup], stats: StepStats, seconds: float, trained_on: int) -> dict:
        rewards = np.concatenate([g.rewards for g in groups])
        zero_var = self.zero_variance_since_step / max(1, self.accepted_since_step)
        self.accepted_since_step = self.zero_variance_since_step = 0
        return {
            "step": self.step,
            "policy_version": self.version,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "loss": stats.loss,
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            "grad_norm": stats.grad_norm,
            "skipped": stats.skipped,  # why no update was applied (non-finite loss or gradient), or None
            "peak_memory_bytes": stats.peak_memory_bytes,
            "groups": len(groups),
            "tokens": int(sum(g.num_tokens for g in groups)),
            # Versions between the snapshot that sampled a group and the policy it trained.
            "staleness_mean": float(np.mean([trained_on - g.policy_version for g in groups])),
            "zero_variance_fraction": zero_var,
            "step_seconds": seconds,
            "wall_seconds": time.monotonic() - self.started,
            "actors": len(self.actors),
        }

    def _observe_step(self, record: dict) -> None:
        mt = self.metrics
        mt.steps.inc()
        mt.policy_version.set(self.version)
        mt.reward.set(record["reward_mean"])
        mt.loss.set(record["loss"])
        mt.kl.set(record["kl"])
        mt.clip_fraction.set(record["clip_fraction"])
        mt.zero_variance_fraction.set(record["zero_variance_fraction"])
        mt.step_seconds.observe(record["step_seconds"])

    def close(self) -> None:
        self._metrics_file.close()
        self._ledger_file.close()
