"""The training thread's part of the run: buffer -> check -> step -> publish -> checkpoint, in a loop.

The lock is held only to take a batch from the hand-off and to record the
result: not while the model trains, the new snapshot is serialised, or a
checkpoint is written, so requests keep being answered meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from grpo_fleet.learner.door.logprob_check import check_next_batch
from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.run.rooms import RunRooms

log = logging.getLogger("grpo_fleet.learner")


class TrainingThread:
    """Trains whenever the hand-off holds a batch; checkpoints when due, and on request."""

    def __init__(self, rooms: RunRooms) -> None:
        self.rooms = rooms
        self._saving = threading.Lock()  # one checkpoint written at a time, outside the run's lock

    def run(self, should_stop: Callable[[], bool]) -> None:
        """The thread's loop, until the run is done or `should_stop()`; then the final eval round."""
        rooms = self.rooms
        local = LocalEvaluator(rooms, rooms.make_scorer)
        try:
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
            local.close()

    def ready(self) -> bool:
        with self.rooms.lock:
            return self.rooms.cycle.ready(self.rooms.state)

    def wait_for_batch(self, timeout: float) -> bool:
        """Block until a batch is buffered (or `timeout` passes)."""
        return self.rooms.handoff.wait(self.ready, timeout)

    def train_step(self) -> Optional[StepRecord]:
        """One optimizer batch from the oldest informative groups; publishes and checkpoints when due.

        None when the logprob check dropped groups (learner/door/logprob_check.py): no step yet.
        """
        rooms, state = self.rooms, self.rooms.state
        if rooms.logprob_check is not None and not check_next_batch(
                rooms.lock, state, rooms.intake, rooms.logprob_check, rooms.cfg.grpo.groups_per_step):
            return None
        with rooms.lock:
            rooms.cycle.drop_too_stale(state)
            if not rooms.cycle.ready(state):
                return None
            groups, trained_on = rooms.cycle.take_batch(state)
            step = state.step + 1  # only this thread moves the step
        trained = rooms.cycle.run(groups, trained_on, step)
        # Decoding and writing samples.jsonl take no lock: `groups` left the shared buffer
        # above, only this thread writes the file, and the log sizes a checkpoint records
        # are taken on this thread too (below; `checkpoint()` on the main thread runs only
        # once this one has stopped). Written before the step is recorded, so the
        # checkpoint of this step, and a resume from it, keep this step's samples.
        rooms.samples.after_step(groups, step)
        with rooms.lock:
            if trained.stats.skipped is not None:
                rooms.intake.blame_poisoned(groups, trained.stats, step)
            record = rooms.cycle.record(state, trained, actors=len(rooms.registry.actors))
            rooms.leasing.step_finished()
            if rooms.evaluation.due(state.step, final=state.done):
                rooms.evaluation.start(state.step, state.version)
            saved = persistence.capture(state, rooms.runlog.sizes()) if rooms.cycle.checkpoint_due(state) else None
        if trained.snapshot is not None and rooms.weight_history is not None:
            rooms.weight_history.record(trained.snapshot.version)
        rooms.trackers.log_record(record)  # outside the lock: a slow tracker holds up no request
        if saved is not None:
            started = time.perf_counter()
            self._save(saved)
            trained.phases.checkpoint = time.perf_counter() - started
        rooms.cycle.observe_phases(trained.phases)
        return record

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint; the state is copied under the lock."""
        with self.rooms.lock:
            saved = persistence.capture(self.rooms.state, self.rooms.runlog.sizes())
        return self._save(saved)

    def _save(self, saved: persistence.SavedState) -> Path:
        rooms = self.rooms
        with self._saving:
            return persistence.save(saved, rooms.policy, rooms.trainer, rooms.run_dir, keep=rooms.cfg.train.keep_checkpoints)

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        rooms, state = self.rooms, self.rooms.state
        saved = persistence.load(checkpoint, rooms.policy, rooms.trainer)
        with rooms.lock:
            persistence.restore(state, saved)
            rooms.evaluation.current = None  # rounds are not checkpointed: the next one is due at its step
            # Groups accepted after this checkpoint are forgotten here and re-queued by
            # their leases, so the ledger must forget them too to stay exactly-once.
            rooms.runlog.truncate(saved.logs)
            rooms.snapshots.install(rooms.snapshots.serialize(state.version))
            if rooms.weight_history is not None:
                rooms.weight_history.versions.clear()
                rooms.weight_history.record(state.version)
            rooms.metrics.policy_version.set(state.version)
        log.info("resumed run %s at step %d (policy v%d) from %s as incarnation %s",
                 state.run_id, state.step, state.version, checkpoint, state.incarnation)
