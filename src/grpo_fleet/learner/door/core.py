"""The learner's front desk: the lock its rooms share, and which room answers each message type.

`server.py` owns the ZeroMQ loop and calls `handle()`; the rooms (registry,
leasing, intake, snapshots, training, runlog) take and return plain typed
records, so all of it can be tested without a network. The I/O thread
(`handle`) and the training thread (`train_step`) share `state` under `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from pydantic import BaseModel

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.intake import Intake
from grpo_fleet.learner.door.intake_rules import IntakeRules
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.door.requests import OBSERVER_REQUESTS, Request, refuse_observer, undecodable
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.door.verification import LogprobCheck, RewardCheck, WeightHistory, check_next_batch
from grpo_fleet.learner.door.welcome import run_card
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.fleet.bans import peer_key
from grpo_fleet.learner.fleet.leasing import Leasing
from grpo_fleet.learner.fleet.registry import ActorInfo, Registry
from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import RunLog, StepRecord
from grpo_fleet.learner.records.samples import SampleLog, tokenizer_decode
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.records.trackers import Trackers
from grpo_fleet.learner.step.gap_bounds import compute_dtype
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.run.batch_cycle import Training
from grpo_fleet.metrics import LearnerMetrics
from grpo_fleet.model import Policy
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess

log = logging.getLogger("grpo_fleet.learner")


# Handlers for anyone, and for registered actors only; each message type has one.
OpenHandler = Callable[[Request, Any], Reply]
ActorHandler = Callable[[ActorInfo, Any], Reply]


class Learner:
    """Single source of truth for the run: leases, accepted groups, steps and versions."""

    def __init__(self, cfg: RunConfig, policy: Policy, trainer: Trainer, task: Task, prompt_tokens: list[np.ndarray],
                 model_digest: str, metrics: LearnerMetrics, run_dir: Path, pub_address: Optional[str] = None,
                 eval_prompt_tokens: Optional[list[np.ndarray]] = None,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess) -> None:
        self.cfg, self.policy, self.trainer, self.task = cfg, policy, trainer, task
        self.prompt_tokens, self.model_digest, self.metrics, self.run_dir = prompt_tokens, model_digest, metrics, run_dir
        self.pub_address = pub_address
        self.card = run_card(cfg, policy, task, model_digest)
        scheduler = PromptScheduler(len(prompt_tokens), seed=cfg.train.seed, lease_seconds=cfg.server.lease_seconds)
        self.state = LearnerState(run_id=uuid.uuid4().hex[:12], incarnation=uuid.uuid4().hex[:12],
                                  steps_target=cfg.train.steps, scheduler=scheduler)
        self.lock = threading.RLock()
        self.batch_ready = threading.Condition(self.lock)  # the training thread sleeps on it
        self._saving = threading.Lock()  # one checkpoint written at a time, outside `lock`
        self.runlog = RunLog(run_dir)
        self.registry = Registry(cfg.server, metrics)
        self.leasing = Leasing(cfg, self.state, metrics, prompt_tokens, task.train)
        self.snapshots = SnapshotStore(policy, cfg.server.weight_chunk_bytes, metrics)
        security = cfg.security
        # Rewards are re-scored in a process of the learner's own, which can kill a reward that hangs; never
        # in this one, which could not. (Unit tests, which may start no process, pass an in-process scorer.)
        self.make_scorer = make_scorer  # the local evaluator's rewards run in one of these too
        self.reward_check = (RewardCheck(task, task.train, policy.tokenizer, make_scorer(task.reward_set()))
                             if security.verify_rewards else None)
        rules = IntakeRules.from_config(cfg, policy.vocab_size, compute_dtype(policy.model))
        self.intake = Intake(rules, self.state, self.registry,
                             self.leasing, self.runlog, metrics, prompt_tokens, self.batch_ready.notify,
                             self.reward_check)
        self.weight_history = (WeightHistory(policy.model, keep=cfg.grpo.max_staleness + cfg.server.in_flight_steps + 1)
                               if security.verify_logprobs else None)
        self.logprob_check = None if self.weight_history is None else LogprobCheck(
            policy.model, self.weight_history, temperature=cfg.generation.temperature,
            chunk_tokens=cfg.train.logprob_chunk_tokens, micro_batch_tokens=cfg.train.micro_batch_tokens,
            max_gap=security.max_logprob_gap, observe=metrics.logprob_gap.observe,
            observe_seconds=metrics.logprob_check_seconds.observe)
        if self.weight_history is not None:
            self.weight_history.record(0)
        self.training = Training(cfg, trainer, self.snapshots, self.runlog, metrics)
        eval_check = (None if self.reward_check is None
                      else RewardCheck(task, task.eval, policy.tokenizer, self.reward_check.scorer))
        self.evaluation = Evaluation(cfg, task.eval, eval_prompt_tokens or [], policy.vocab_size, self.state,
                                     self.registry, self.runlog, metrics, reward_check=eval_check)
        if self.evaluation.due(0, final=False):
            self.evaluation.start(0, 0)  # the baseline: held-out reward before any training
        self.samples = SampleLog(cfg, tokenizer_decode(policy.tokenizer), self.runlog)
        self.trackers = Trackers([], metrics.tracker_errors)  # setup opens logging.report_to's once the step is known
        # Answered for anyone; every other request needs a Hello from this identity first.
        self._open: dict[type, OpenHandler] = {
            m.Hello: self._on_hello,
            m.StatusRequest: lambda req, msg: Reply(self.registry.status(self.state)),
        }
        self._registered: dict[type, ActorHandler] = {
            m.Heartbeat: self._on_heartbeat,
            m.GetWeights: lambda actor, msg: self.snapshots.chunk(msg),
            # Eval leases go first: a round is small, and its figures are for the version it started at.
            m.LeaseRequest: lambda actor, msg: Reply(self.evaluation.grant(actor, msg) or self.leasing.grant(actor, msg)),
            m.Rollouts: lambda actor, msg: Reply(self.evaluation.take(actor, msg) if self.evaluation.owns(msg.lease_id)
                                                 else self.intake.take(actor, msg)),
        }

    # ------------------------------------------------------------------ requests (I/O thread)

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
            owner = self.evaluation if self.evaluation.owns(msg.lease_id) else self.intake
            jobs = owner.reward_jobs(actor, msg) if actor is not None else []
            check = owner.reward_check
        if check is None or not jobs:
            return self.handle(identity, msg, principal, peer_address)
        check.score_ahead(jobs)
        try:
            return self.handle(identity, msg, principal, peer_address)
        finally:
            check.forget_ahead()

    def _dispatch(self, req: Request, msg: BaseModel) -> Reply:
        kind = type(msg)
        if kind in self._open:
            return self._open[kind](req, msg)
        actor = self.registry.known(req.identity, req.owner)
        if actor is None:
            return Reply(m.ErrorReply(reason="not_registered", detail="send Hello first"))
        handler = self._registered.get(kind)
        if handler is None:
            self.metrics.protocol_errors.labels(reason="unexpected_type").inc()
            self.registry.record_violation(req.owner, "unexpected_type")
            return Reply(m.ErrorReply(reason="unexpected_type", detail=f"{kind.__name__} is not a request"))
        return handler(actor, msg)

    def _on_hello(self, req: Request, hello: m.Hello) -> Reply:
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

    def _on_heartbeat(self, actor: ActorInfo, beat: m.Heartbeat) -> Reply:
        actor.policy_version = beat.policy_version
        return Reply(m.Heartbeat(actor_id=actor.actor_id, policy_version=self.state.version, sent_at=time.time(),
                                 incarnation=self.state.incarnation))

    def drop_actor(self, identity: bytes) -> int:
        """Forget an actor (silent or revoked) and re-queue its leases; returns the lease count."""
        with self.lock:
            info = self.registry.drop(identity)
            if info is None:
                return 0
            self.evaluation.release_actor(info.principal)
            return self.state.scheduler.release_actor(info.principal)

    def expire_leases(self) -> int:
        """Re-queue leases past their deadline; returns how many expired."""
        with self.lock:
            self.evaluation.expire()
            return self.leasing.expire()

    def refresh_service_discovery(self, learner_target: Optional[str]) -> None:
        """Rebuild the /sd answer on the main thread; the HTTP thread reads the list it swaps in."""
        with self.lock:
            self.registry.refresh_service_discovery(learner_target)

    # ------------------------------------------------------------------ training (training thread)

    def ready_to_train(self) -> bool:
        with self.lock:
            return self.training.ready(self.state)

    def wait_for_batch(self, timeout: float) -> bool:
        """Block the training thread until a batch is buffered (or `timeout` passes)."""
        with self.batch_ready:
            return self.batch_ready.wait_for(self.ready_to_train, timeout)

    def train_step(self) -> Optional[StepRecord]:
        """One optimizer batch from the oldest informative groups; publishes and checkpoints when due.

        The lock is held only to take the batch and to record the result: not
        while the model trains, the new snapshot is serialised, or a checkpoint
        is written, so requests keep being answered meanwhile. None when the
        logprob check dropped groups (learner/door/verification.py): no step yet.
        """
        if self.logprob_check is not None and not check_next_batch(
                self.lock, self.state, self.intake, self.logprob_check, self.cfg.grpo.groups_per_step):
            return None
        with self.lock:
            self.training.drop_too_stale(self.state)
            if not self.training.ready(self.state):
                return None
            groups, trained_on = self.training.take_batch(self.state)
            step = self.state.step + 1  # only this thread moves the step
        trained = self.training.run(groups, trained_on, step)
        # Decoding and writing samples.jsonl take no lock: `groups` left the shared buffer
        # above, only this thread writes the file, and the log sizes a checkpoint records
        # are taken on this thread too (below; `checkpoint()` on the main thread runs only
        # once this one has stopped). Written before the step is recorded, so the
        # checkpoint of this step, and a resume from it, keep this step's samples.
        self.samples.after_step(groups, step)
        with self.lock:
            if trained.stats.skipped is not None:
                self.intake.blame_poisoned(groups, trained.stats, step)
            record = self.training.record(self.state, trained, actors=len(self.registry.actors))
            self.leasing.step_finished()
            if self.evaluation.due(self.state.step, final=self.state.done):
                self.evaluation.start(self.state.step, self.state.version)
            saved = persistence.capture(self.state, self.runlog.sizes()) if self.training.checkpoint_due(self.state) else None
        if trained.snapshot is not None and self.weight_history is not None:
            self.weight_history.record(trained.snapshot.version)
        self.trackers.log_record(record)  # outside the lock: a slow tracker holds up no request
        if saved is not None:
            started = time.perf_counter()
            self._save(saved)
            trained.phases.checkpoint = time.perf_counter() - started
        self.training.observe_phases(trained.phases)
        return record

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint; the state is copied under the lock."""
        with self.lock:
            saved = persistence.capture(self.state, self.runlog.sizes())
        return self._save(saved)

    def _save(self, saved: persistence.SavedState) -> Path:
        with self._saving:
            return persistence.save(saved, self.policy, self.trainer, self.run_dir, keep=self.cfg.train.keep_checkpoints)

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        saved = persistence.load(checkpoint, self.policy, self.trainer)
        with self.lock:
            persistence.restore(self.state, saved)
            self.evaluation.current = None  # rounds are not checkpointed: the next one is due at its step
            # Groups accepted after this checkpoint are forgotten here and re-queued by
            # their leases, so the ledger must forget them too to stay exactly-once.
            self.runlog.truncate(saved.logs)
            self.snapshots.install(self.snapshots.serialize(self.state.version))
            if self.weight_history is not None:
                self.weight_history.versions.clear()
                self.weight_history.record(self.state.version)
            self.metrics.policy_version.set(self.state.version)
        log.info("resumed run %s at step %d (policy v%d) from %s as incarnation %s",
                 self.state.run_id, self.state.step, self.state.version, checkpoint, self.state.incarnation)

    def close(self) -> None:
        if self.reward_check is not None:
            self.reward_check.close()
        self.trackers.close()
        self.runlog.close()
