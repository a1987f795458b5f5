"""One optimizer batch of the training thread's loop (training_thread.py): take the batch from the hand-off, run
`Trainer.step` on it, publish when due, record the step.

Kept apart from the loop, which holds the lock, checks, checkpoints and resumes: this is the step's own work
and its records (its phases, its check tally, its metrics.jsonl line and gauges).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import RunLog, StepRecord
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.run.episode_stats import episode_stats, turn_decoder
from grpo_fleet.learner.step.batch import LengthShaping, build_train_batch
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.step_result import LOGPROB_MISMATCH, LOGPROB_SCREEN, StepStats
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.protocol.weights import Snapshot


@dataclass
class StepPhases:
    """Wall seconds of one step's phases, for `grpo_fleet_learner_step_phase_seconds{phase}`."""

    data_prep: float
    ref_forward: float
    update: float
    proximal_forward: Optional[float] = None  # only when the step makes its own pi_prox forward (FrozenForwards.proximal)
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

    @property
    def published(self) -> Optional[int]:
        """The version this step published, if it did (the logprob check keeps its weights: verify/batch_checks.py)."""
        return None if self.snapshot is None else self.snapshot.version


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
        for gauge, value in ((mt.kl, record.kl), (mt.clip_fraction, record.clip_fraction),
                             (mt.ratio_mean, record.ratio_mean)):
            if value is not None:  # a statistic the loss does not compute is not reported as 0
                gauge.set(value)
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
