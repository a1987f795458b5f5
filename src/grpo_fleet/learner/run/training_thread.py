"""The training thread's part of the run: hand-off -> check -> step -> publish -> checkpoint, in a loop.

`TrainingThread` is the loop; `BatchCycle` (batch_cycle.py) is one optimizer
batch in it: take the batch from the hand-off, run `Trainer.step` on it, publish
when due, record the step. The lock is held only to take a batch and to record the result: not
while the model trains, the new snapshot is serialised, or a checkpoint is
written, so requests keep being answered meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.run.batch_cycle import BatchCycle, CheckTally
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.run.rooms import RunRooms
from grpo_fleet.learner.verify.batch_checks import BatchChecks

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

        None when no batch is ready, or the logprob check (verify/batch_checks.py)
        found a lie in the batch: its actor is banned, everything of it dropped,
        the rest of the batch back in the buffer, and no step taken yet.
        """
        rooms, state = self.rooms, self.rooms.state
        checked = self.checks.train(self.cycle)  # taken, checked and trained: the one call into verify/ per batch
        if checked is None:
            return None
        groups, step, trained = checked.groups, checked.step, checked.trained
        # Decoding and writing samples.jsonl take no lock: `groups` left the shared buffer
        # above, only this thread writes the file, and the log sizes a checkpoint records
        # are taken on this thread too (below; `checkpoint()` on the main thread runs only
        # once this one has stopped). Written before the step is recorded, so the
        # checkpoint of this step, and a resume from it, keep this step's samples.
        rooms.samples.after_step(groups, step)
        with rooms.lock:
            if trained.stats.skipped is not None:
                rooms.intake.blame_poisoned(groups, trained.stats, step)
            record = self.cycle.record(state, trained, actors=len(rooms.registry.actors),
                                       checks=CheckTally(checked.seconds, checked.checked, checked.unchecked))
            rooms.leasing.step_finished()
            if rooms.evaluation.due(state.step, final=state.done):
                rooms.evaluation.start(state.step, state.version)
            saved = self._capture() if self.cycle.checkpoint_due(state) else None
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
