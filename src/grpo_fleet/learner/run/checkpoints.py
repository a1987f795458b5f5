"""Checkpoints of the run: written from the training thread when due (or at a stop), and resumed from.

The state is copied under the run's lock and written outside it, so requests keep being answered while the
weights go to disk (learner/records/persistence.py does the writing).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.actor_checks import WeightHistory
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import LearnerMetrics

log = logging.getLogger("grpo_fleet.learner")


class Checkpoints:
    """Weights, optimizer and learner state as one checkpoint in `run_dir`; the newest `keep` are kept.

    `history` is the logprob check's kept versions (None when logprobs are not checked): saved with a
    checkpoint under LoRA, and restored from one.
    """

    def __init__(self, lock: AbstractContextManager[Any], state: LearnerState, policy: Policy, trainer: Trainer,
                 run_dir: Path, keep: int, runlog: RunLog, registry: Registry, evaluation: Evaluation,
                 snapshots: SnapshotStore, history: Optional[WeightHistory], metrics: LearnerMetrics) -> None:
        self.lock, self.state, self.policy, self.trainer, self.run_dir, self.keep = lock, state, policy, trainer, run_dir, keep
        self.runlog, self.registry, self.evaluation, self.snapshots = runlog, registry, evaluation, snapshots
        self.history, self.metrics = history, metrics
        self._saving = threading.Lock()  # one checkpoint written at a time, outside the run's lock

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint; the state is copied under the lock."""
        with self.lock:
            saved = self.capture()
        return self.save(saved)

    def capture(self) -> persistence.SavedState:
        """What a checkpoint saves, the peers' bans and ban counts included (the caller holds the lock)."""
        return persistence.capture(self.state, self.runlog.sizes(), bans=self.registry.bans.export(time.time()))

    def save(self, saved: persistence.SavedState) -> Path:
        """Write what `capture` took (no lock held)."""
        with self._saving:
            return persistence.save(saved, self.policy, self.trainer, self.run_dir, keep=self.keep,
                                    history=self._kept_versions())

    def _kept_versions(self) -> Optional[persistence.KeptVersions]:
        """The logprob check's kept versions, saved with a checkpoint under LoRA (adapters only: small); a full
        fine-tuning resume refuses groups of versions it no longer holds instead (version_gone)."""
        if self.history is None or self.policy.lora is None:
            return None
        return dict(self.history.versions)

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        state = self.state
        saved = persistence.load(checkpoint, self.policy, self.trainer)
        with self.lock:
            persistence.restore(state, saved)
            # A liar banned before the checkpoint stays banned, and keeps its count of bans (learner/actors/bans.py).
            self.registry.bans.load(saved.bans, time.time())
            self.metrics.banned_peers.set(self.registry.bans.banned_count())
            self.evaluation.current = None  # rounds are not checkpointed: the next one is due at its step
            # Groups accepted after this checkpoint are forgotten here and re-queued by
            # their leases, so the ledger must forget them too to stay exactly-once.
            self.runlog.truncate(saved.logs)
            self.snapshots.install(self.snapshots.serialize(state.version))
            if self.history is not None:
                # Every version intake may still accept, as the life that saved the checkpoint held them (under
                # LoRA); the live weights are the current one's.
                self.history.versions.clear()
                self.history.versions.update(persistence.load_history(checkpoint))
                self.history.record(state.version)
            self.metrics.policy_version.set(state.version)
        log.info("resumed run %s at step %d (policy v%d) from %s as incarnation %s",
                 state.run_id, state.step, state.version, checkpoint, state.incarnation)
