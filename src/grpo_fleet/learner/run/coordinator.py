"""The run's coordinator: the rooms of one run (learner/run/rooms.py) and the two threads that work on them.

`learner/door/server.py` owns the ZeroMQ loop: on the I/O thread it calls
`requests` (learner/run/handlers.py, the handler table), and it runs
`training` (learner/run/training_thread.py, the loop) on the training thread. The two
threads share the rooms under `lock`, and meet at one named hand-off
(learner/records/state.py): intake puts accepted groups in, training takes
batches out. Every room takes and returns plain typed records, so all of it
can be tested without a network.

The coordinator is where the parts are wired: each (the handler table, the training thread, its checkpoints
(checkpoints.py), the local evaluator) is handed the rooms it works on, by name. The batch's check plan
(learner/verify/batch_checks.py) still reads the run through its own protocol, `CheckedRun`, which the
coordinator meets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
from pydantic import BaseModel

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.run.batch_cycle import BatchCycle
from grpo_fleet.learner.run.checkpoints import Checkpoints
from grpo_fleet.learner.run.handlers import RequestHandlers
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.run.rooms import RunRooms
from grpo_fleet.learner.run.training_thread import TrainingThread
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.batch_checks import BatchChecks
from grpo_fleet.learner.verify.env_replay import EnvCalling
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess


class RunCoordinator(RunRooms):
    """The run's rooms, with the I/O thread's `requests` and the training thread's `training`."""

    def __init__(self, cfg: RunConfig, policy: Policy, trainer: Trainer, task: Task, prompt_tokens: list[np.ndarray],
                 model_digest: str, metrics: LearnerMetrics, run_dir: Path, pub_address: Optional[str] = None,
                 eval_prompt_tokens: Optional[list[np.ndarray]] = None,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess,
                 make_envs: Callable[[EnvSetup], EnvCalling] = EnvProcess) -> None:
        super().__init__(cfg, policy, trainer, task, prompt_tokens, model_digest, metrics, run_dir,
                         eval_prompt_tokens=eval_prompt_tokens, make_scorer=make_scorer, make_envs=make_envs)
        self.requests = RequestHandlers(self.lock, self.state, self.registry, self.leasing, self.evaluation,
                                        self.intake, self.snapshots, self.card, metrics, cfg.server.heartbeat_seconds,
                                        pub_address)
        self.checkpoints = Checkpoints(self.lock, self.state, policy, trainer, run_dir, cfg.train.keep_checkpoints,
                                       self.runlog, self.registry, self.evaluation, self.snapshots,
                                       self.verification.history, metrics)
        self.training = self._training_thread()

    def _training_thread(self) -> TrainingThread:
        cycle = BatchCycle(self.cfg, self.trainer, self.handoff, self.snapshots, self.runlog, self.metrics)
        local = LocalEvaluator(self.cfg, self.task, self.policy, self.lock, self.state, self.registry, self.evaluation,
                               self.trackers, self.make_scorer)
        return TrainingThread(self.lock, self.state, self.handoff, cycle, BatchChecks(self), local, self.checkpoints,
                              verification=self.verification, samples=self.samples, intake=self.intake,
                              registry=self.registry, leasing=self.leasing, evaluation=self.evaluation,
                              trackers=self.trackers)

    @property
    def pub_address(self) -> Optional[str]:
        """Where actors hear notices, as Welcome names it: set by the loop once its PUB is bound."""
        return self.requests.pub_address

    @pub_address.setter
    def pub_address(self, address: Optional[str]) -> None:
        self.requests.pub_address = address

    # ------------------------------------------------------------------ requests (I/O thread): RequestHandlers

    def handle(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply:
        return self.requests.handle(identity, msg, principal, peer_address, observer=observer)

    def drop_actor(self, identity: bytes) -> int:
        return self.requests.drop_actor(identity)

    def expire_leases(self) -> int:
        return self.requests.expire_leases()

    # ------------------------------------------------------------------ training (training thread)

    def ready_to_train(self) -> bool:
        return self.training.ready()

    def train_step(self) -> Optional[StepRecord]:
        """One optimizer batch; see TrainingThread.train_step."""
        return self.training.train_step()

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> Path:
        """Write weights, optimizer and learner state as one checkpoint."""
        return self.checkpoints.checkpoint()

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        self.checkpoints.resume(checkpoint)

    def close(self) -> None:
        self.verification.close()
        self.trackers.close()
        self.runlog.close()
