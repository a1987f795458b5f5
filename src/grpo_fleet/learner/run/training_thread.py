"""The training thread's part of the run: hand-off -> check -> step -> publish -> checkpoint, in a loop.

`TrainingThread` is the loop; `BatchCycle` (batch_cycle.py) is one optimizer
batch in it: take the batch from the hand-off, run `Trainer.step` on it, publish
when due, record the step. The lock is held only to take a batch and to record the result: not
while the model trains, the new snapshot is serialised, or a checkpoint is
written, so requests keep being answered meanwhile.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Optional

from grpo_fleet.learner.actors.leasing import Leasing
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.intake import Intake
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.records.samples import SampleLog
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.records.trackers import Trackers
from grpo_fleet.learner.run.batch_cycle import BatchCycle, CheckTally
from grpo_fleet.learner.run.checkpoints import Checkpoints
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.verify.batch_checks import BatchChecks
from grpo_fleet.learner.verify.verification import Verification


class TrainingThread:
    """Trains whenever the hand-off holds a batch; checkpoints when due, and on request.

    `cycle` runs one batch, `checks` checks it, `local` evaluates a round no actor takes, `checkpoints` writes
    them; the rest is what hears of each step: `samples`, `intake` (blames a poisoned batch), `leasing`,
    `evaluation` (a round when due), `trackers`, and `verification`'s kept versions.
    """

    def __init__(self, lock: AbstractContextManager[Any], state: LearnerState, handoff: BatchHandOff,
                 cycle: BatchCycle, checks: BatchChecks, local: LocalEvaluator, checkpoints: Checkpoints, *,
                 verification: Verification, samples: SampleLog, intake: Intake, registry: Registry,
                 leasing: Leasing, evaluation: Evaluation, trackers: Trackers) -> None:
        self.lock, self.state, self.handoff, self.cycle, self.checks = lock, state, handoff, cycle, checks
        self.local, self.checkpoints, self.verification, self.samples = local, checkpoints, verification, samples
        self.intake, self.registry, self.leasing, self.evaluation = intake, registry, leasing, evaluation
        self.trackers = trackers

    def run(self, should_stop: Callable[[], bool]) -> None:
        """The thread's loop, until the run is done or `should_stop()`; then the final eval round."""
        local = self.local
        try:
            self.verification.calibration.run()  # before anything else uses the model on this thread (gap_calibration.py)
            while not should_stop() and not self.state.done:
                local.run_if_needed()
                if self.wait_for_batch(timeout=0.1):
                    self.train_step()
                else:
                    self.cycle.trainer.sharding.idle()  # a data-parallel rank 0's keepalive
            # The final eval round: answered by actors, or evaluated here if none is left.
            while not should_stop() and local.pending():
                if not local.run_if_needed():
                    time.sleep(0.05)
        finally:
            self.verification.calibration.abandon()  # stopped before it measured: intake must not wait for it
            local.close()

    def ready(self) -> bool:
        with self.lock:
            return self.cycle.ready(self.state)

    def wait_for_batch(self, timeout: float) -> bool:
        """Block until a batch is buffered (or `timeout` passes)."""
        return self.handoff.wait(self.ready, timeout)

    def train_step(self) -> Optional[StepRecord]:
        """One optimizer batch from the oldest informative groups; publishes and checkpoints when due.

        None when no batch is ready, or the logprob check (verify/batch_checks.py)
        found a lie in the batch: its actor is banned, everything of it dropped,
        the rest of the batch back in the buffer, and no step taken yet.
        """
        state = self.state
        checked = self.checks.train(self.cycle)  # taken, checked and trained: the one call into verify/ per batch
        if checked is None:
            return None
        groups, step, trained = checked.groups, checked.step, checked.trained
        # Decoding and writing samples.jsonl take no lock: `groups` left the shared buffer
        # above, only this thread writes the file, and the log sizes a checkpoint records
        # are taken on this thread too (below; `checkpoint()` on the main thread runs only
        # once this one has stopped). Written before the step is recorded, so the
        # checkpoint of this step, and a resume from it, keep this step's samples.
        self.samples.after_step(groups, step)
        with self.lock:
            if trained.stats.skipped is not None:
                self.intake.blame_poisoned(groups, trained.stats, step)
            record = self.cycle.record(state, trained, actors=len(self.registry.actors),
                                       checks=CheckTally(checked.seconds, checked.checked, checked.unchecked))
            self.leasing.step_finished()
            if self.evaluation.due(state.step, final=state.done):
                self.evaluation.start(state.step, state.version)
            saved = self.checkpoints.capture() if self.cycle.checkpoint_due(state) else None
        self.trackers.log_record(record)  # outside the lock: a slow tracker holds up no request
        if saved is not None:
            started = time.perf_counter()
            self.checkpoints.save(saved)
            trained.phases.checkpoint = time.perf_counter() - started
        self.cycle.observe_phases(trained.phases)
        return record

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint (checkpoints.py)."""
        return self.checkpoints.checkpoint()
