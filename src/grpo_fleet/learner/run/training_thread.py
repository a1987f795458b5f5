"""The training thread's part of the run: hand-off -> check -> step -> publish -> checkpoint, in a loop.

`TrainingThread` is the loop; `BatchCycle` is one optimizer batch in it: take
the batch from the hand-off, run `Trainer.step` on it, publish when due, record
the step. The lock is held only to take a batch and to record the result: not
while the model trains, the new snapshot is serialised, or a checkpoint is
written, so requests keep being answered meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import RunLog, StepRecord
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.run.episode_stats import episode_stats, turn_decoder
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.run.rooms import RunRooms
from grpo_fleet.learner.step.batch import LengthShaping, build_train_batch
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.step_result import LOGPROB_MISMATCH, LOGPROB_SCREEN, StepStats
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.batch_checks import BatchChecks
from grpo_fleet.metrics import LearnerMetrics
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.protocol.weights import Snapshot

log = logging.getLogger("grpo_fleet.learner")


class TrainingThread:
    """Trains whenever the hand-off holds a batch; checkpoints when due, and on request."""

    def __init__(self, rooms: RunRooms) -> None:
        self.rooms = rooms
        self.cycle = BatchCycle(rooms.cfg, rooms.trainer, rooms.handoff, rooms.snapshots, rooms.runlog, rooms.metrics)
        self.checks = BatchChecks(rooms)
        self._saving = threading.Lock()  # one checkpoint written at a time, outside the run's lock

    def run(self, should_stop: Callable[[], bool]) -> None:
        """The thread's loop, until the run is done or `should_stop()`; then the final eval round."""
        rooms = self.rooms
        local = LocalEvaluator(rooms, rooms.make_scorer)
        try:
            rooms.verification.calibration.run()  # before anything else uses the model on this thread (gap_calibration.py)
            while not should_stop() and not rooms.state.done:
                local.run_if_needed()
                if self.wait_for_batch(timeout=0.1):
                    self.train_step()
                else:
                    rooms.trainer.sharding.idle()  # a data-parallel rank 0's keepalive
            # The final eval round: answered by actors, or evaluated here if none is left.
            while not should_stop() and local.pending():
                if not local.run_if_needed():
                    time.sleep(0.05)
        finally:
            rooms.verification.calibration.abandon()  # stopped before it measured: intake must not wait for it
            local.close()

    def ready(self) -> bool:
        with self.rooms.lock:
            return self.cycle.ready(self.rooms.state)

    def wait_for_batch(self, timeout: float) -> bool:
        """Block until a batch is buffered (or `timeout` passes)."""
        return self.rooms.handoff.wait(self.ready, timeout)

    def train_step(self) -> Optional[StepRecord]:
        """One optimizer batch from the oldest informative groups; publishes and checkpoints when due.

        None when the logprob check (verify/batch_checks.py) found a lie in the batch:
        its actor is banned, everything of it dropped, the rest of the batch back
        in the buffer, and no step taken yet.
        """
        rooms, state = self.rooms, self.rooms.state
        with rooms.lock:
            # Stale groups go first, then the batch is taken and checked as it is: no group slides in unchecked.
            self.cycle.drop_too_stale(state)
            self.checks.drop_unverifiable(state)
            if not self.cycle.ready(state):
                return None
            groups, trained_on = self.cycle.take_batch(state)
            plan = self.checks.plan(groups, trained_on, state.weights_published)
            step = state.step + 1  # only this thread moves the step
        if not self.checks.forward(plan, groups):
            return None
        trained = self.cycle.run(groups, trained_on, step, plan.fused_bounds(), plan.recheck)
        if not self.checks.fused(plan, groups, trained.stats):
            return None
        # Decoding and writing samples.jsonl take no lock: `groups` left the shared buffer
        # above, only this thread writes the file, and the log sizes a checkpoint records
        # are taken on this thread too (below; `checkpoint()` on the main thread runs only
        # once this one has stopped). Written before the step is recorded, so the
        # checkpoint of this step, and a resume from it, keep this step's samples.
        rooms.samples.after_step(groups, step)
        with rooms.lock:
            if trained.stats.skipped is not None:
                rooms.intake.blame_poisoned(groups, trained.stats, step)
            self.checks.record_unchecked(plan, step)
            record = self.cycle.record(state, trained, actors=len(rooms.registry.actors),
                                       checks=CheckTally(plan.seconds, plan.checked, len(plan.unchecked)))
            rooms.leasing.step_finished()
            if rooms.evaluation.due(state.step, final=state.done):
                rooms.evaluation.start(state.step, state.version)
            saved = self._capture() if self.cycle.checkpoint_due(state) else None
        if trained.snapshot is not None and rooms.verification.history is not None:
            rooms.verification.history.record(trained.snapshot.version)
        rooms.trackers.log_record(record)  # outside the lock: a slow tracker holds up no request
        if saved is not None:
            started = time.perf_counter()
            self._save(saved)
            trained.phases.checkpoint = time.perf_counter() - started
        self.cycle.observe_phases(trained.phases)
        return record

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint; the state is copied under the lock."""
        with self.rooms.lock:
            saved = self._capture()
        return self._save(saved)

    def _capture(self) -> persistence.SavedState:
        """What a checkpoint saves, the peers' bans and ban counts included (under the lock)."""
        rooms = self.rooms
        return persistence.capture(rooms.state, rooms.runlog.sizes(), bans=rooms.registry.bans.export(time.time()))

    def _save(self, saved: persistence.SavedState) -> Path:
        rooms = self.rooms
        with self._saving:
            return persistence.save(saved, rooms.policy, rooms.trainer, rooms.run_dir, keep=rooms.cfg.train.keep_checkpoints,
                                    history=self._kept_versions())

    def _kept_versions(self) -> Optional[persistence.KeptVersions]:
        """The logprob check's kept versions, saved with a checkpoint under LoRA (adapters only: small); a full
        fine-tuning resume refuses groups of versions it no longer holds instead (version_gone)."""
        history = self.rooms.verification.history
        if history is None or self.rooms.policy.lora is None:
            return None
        return dict(history.versions)

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        rooms, state = self.rooms, self.rooms.state
        saved = persistence.load(checkpoint, rooms.policy, rooms.trainer)
        with rooms.lock:
            persistence.restore(state, saved)
            # A liar banned before the checkpoint stays banned, and keeps its count of bans (learner/fleet/bans.py).
            rooms.registry.bans.load(saved.bans, time.time())
            rooms.metrics.banned_peers.set(rooms.registry.bans.banned_count())
            rooms.evaluation.current = None  # rounds are not checkpointed: the next one is due at its step
            # Groups accepted after this checkpoint are forgotten here and re-queued by
            # their leases, so the ledger must forget them too to stay exactly-once.
            rooms.runlog.truncate(saved.logs)
            rooms.snapshots.install(rooms.snapshots.serialize(state.version))
            if rooms.verification.history is not None:
                # Every version intake may still accept, as the life that saved the checkpoint held them (under
                # LoRA); the live weights are the current one's.
                rooms.verification.history.versions.clear()
                rooms.verification.history.versions.update(persistence.load_history(checkpoint))
                rooms.verification.history.record(state.version)
            rooms.metrics.policy_version.set(state.version)
        log.info("resumed run %s at step %d (policy v%d) from %s as incarnation %s",
                 state.run_id, state.step, state.version, checkpoint, state.incarnation)


@dataclass
class StepPhases:
    """Wall seconds of one step's phases, for `grpo_fleet_learner_step_phase_seconds{phase}`."""

    data_prep: float
    ref_forward: float
    update: float
    proximal_forward: Optional[float] = None  # only when the decoupled objective needs its own pi_prox forward
    publish: Optional[float] = None  # only on steps that publish a version
    checkpoint: Optional[float] = None  # only on steps that write a checkpoint

    def timed(self) -> dict[str, float]:
        return {phase: seconds for phase, seconds in asdict(self).items() if seconds is not None}


@dataclass(frozen=True)
class CheckTally:
    """A step's logprob check, for its metrics.jsonl line: seconds spent, groups checked and trained unchecked."""

    seconds: float = 0.0
    checked: int = 0
    unchecked: int = 0


@dataclass(frozen=True)
class TrainedBatch:
    """What the unlocked part of a step produced, for `BatchCycle.record` to apply."""

    groups: list[AcceptedGroup]
    trained_on: int  # the policy version the batch was trained at
    stats: StepStats
    snapshot: Optional[Snapshot]  # the new version, on steps that publish one
    phases: StepPhases
    started: float  # perf_counter at the start of the step


class BatchCycle:
    """One optimizer batch at a time; the caller holds the lock for `take_batch` and `record` only."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, handoff: BatchHandOff, snapshots: SnapshotStore,
                 runlog: RunLog, metrics: LearnerMetrics) -> None:
        self.grpo, self.train = cfg.grpo, cfg.train
        self.max_train_staleness = (cfg.grpo.max_train_staleness if cfg.grpo.max_train_staleness is not None
                                    else cfg.grpo.max_staleness + cfg.server.in_flight_steps)
        self.lengths = LengthShaping.from_config(cfg)
        self.trainer, self.handoff, self.snapshots, self.runlog, self.metrics = trainer, handoff, snapshots, runlog, metrics

    def ready(self, state: LearnerState) -> bool:
        return not state.done and len(state.buffer) >= self.grpo.groups_per_step

    def drop_too_stale(self, state: LearnerState) -> int:
        """Drop buffered groups beyond grpo.max_train_staleness, re-queueing their prompts; returns how many."""
        bound = self.max_train_staleness
        stale = [g for g in state.buffer if state.version - g.policy_version > bound]
        if stale:
            self.handoff.drop(stale, RejectReason.STALE_AT_TRAIN)
            self.metrics.rejections.labels(reason=RejectReason.STALE_AT_TRAIN).inc(len(stale))
        return len(stale)

    def take_batch(self, state: LearnerState) -> tuple[list[AcceptedGroup], int]:
        """The oldest informative groups, removed from the buffer, and the version they will train."""
        groups = self.handoff.take(self.grpo.groups_per_step)
        for group in groups:  # staleness as trained, not only as it arrived
            self.metrics.train_staleness.observe(state.version - group.policy_version)
        return groups, state.version

    def run(self, groups: list[AcceptedGroup], trained_on: int, step: int,
            check: Optional[np.ndarray] = None, recheck: Optional[Recheck] = None) -> TrainedBatch:
        """Train on `groups` and serialise the new version if `step` publishes; touches no shared state.

        `check`: the bounds of the groups the step checks against its own forward (`TrainBatch.check`);
        `recheck`: the older groups it recomputes at their versions, each rank its rows (`TrainBatch.recheck`).
        """
        started = time.perf_counter()
        batch = build_train_batch(groups, scale_by_std=self.grpo.scales_by_std, lengths=self.lengths)
        batch.check, batch.recheck = check, recheck
        data_prep = time.perf_counter() - started
        stats = self.trainer.step(batch)
        self.metrics.peak_memory.set(stats.peak_memory_bytes)
        phases = StepPhases(data_prep=data_prep, ref_forward=stats.ref_seconds, update=stats.update_seconds,
                            proximal_forward=stats.proximal_seconds or None)
        snapshot = None
        if step % self.train.sync_every == 0 and stats.skipped not in (LOGPROB_MISMATCH, LOGPROB_SCREEN):  # taken again
            publish_started = time.perf_counter()
            snapshot = self.snapshots.serialize(trained_on + 1)
            phases.publish = time.perf_counter() - publish_started
        return TrainedBatch(groups, trained_on, stats, snapshot, phases, started)

    def record(self, state: LearnerState, done: TrainedBatch, actors: int, checks: Optional[CheckTally] = None) -> StepRecord:
        """Move the step (and the version, when published), log the step's line and gauges."""
        state.step += 1
        state.weights_published = done.snapshot is not None
        if done.snapshot is not None:
            state.version = done.snapshot.version
            self.snapshots.install(done.snapshot)
            self.metrics.weight_publish_seconds.observe(done.phases.publish or 0.0)
            self.metrics.weight_publish_bytes.set(len(done.snapshot.blob))
        record = self._step_record(state, done, actors, checks or CheckTally())
        self.runlog.step(record)
        self._observe(record)
        return record

    def checkpoint_due(self, state: LearnerState) -> bool:
        # The final step always writes one: a finished run resumes to nothing left to do.
        return state.step % self.train.checkpoint_every == 0 or state.done

    def observe_phases(self, phases: StepPhases) -> None:
        for phase, seconds in phases.timed().items():
            self.metrics.step_phase_seconds.labels(phase=phase).observe(seconds)

    def _step_record(self, state: LearnerState, done: TrainedBatch, actors: int, checks: CheckTally) -> StepRecord:
        groups, stats = done.groups, done.stats
        rewards = np.concatenate([g.rewards for g in groups])
        zero_var = state.zero_variance_since_step / max(1, state.accepted_since_step)
        state.accepted_since_step = state.zero_variance_since_step = 0
        return StepRecord(
            step=state.step, policy_version=state.version,
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
            **{**stats.update_stats(), **_length_stats(groups),
               **episode_stats(groups, turn_decoder(self.trainer.policy.tokenizer))},
            groups=len(groups), tokens=int(sum(g.num_tokens for g in groups)),
            staleness_mean=float(np.mean([done.trained_on - g.policy_version for g in groups])),
            staleness_max=int(max(done.trained_on - g.policy_version for g in groups)),
            zero_variance_fraction=zero_var, step_seconds=time.perf_counter() - done.started,
            wall_seconds=state.wall_seconds(), actors=actors, check_seconds=checks.seconds,
            groups_checked=checks.checked, groups_unchecked=checks.unchecked,
        )

    def _observe(self, record: StepRecord) -> None:
        mt = self.metrics
        mt.steps.inc()
        mt.policy_version.set(record.policy_version)
        mt.reward.set(record.reward_mean)
        mt.loss.set(record.loss)
        mt.kl.set(record.kl)
        mt.clip_fraction.set(record.clip_fraction)
        mt.ratio_mean.set(record.ratio_mean)
        mt.offpolicy_gap_mean.set(record.offpolicy_gap_mean)
        mt.offpolicy_gap_max.set(record.offpolicy_gap_max)
        mt.is_capped_fraction.set(record.is_capped_fraction)
        mt.completion_length_mean.set(record.completion_length_mean)
        mt.completion_length_max.set(record.completion_length_max)
        mt.truncated_fraction.set(record.truncated_fraction)
        mt.learning_rate.set(record.learning_rate)
        mt.zero_variance_fraction.set(record.zero_variance_fraction)
        mt.step_seconds.observe(record.step_seconds)


def _length_stats(groups: list[AcceptedGroup]) -> dict[str, float]:
    """Completion length mean and max, and the share cut off at generation.max_tokens, over a batch's completions."""
    completions = [c for g in groups for c in g.completions]
    lengths = np.array([len(c.tokens) for c in completions])
    return {"completion_length_mean": float(lengths.mean()), "completion_length_max": float(lengths.max()),
            "truncated_fraction": float(np.mean([c.truncated for c in completions]))}
