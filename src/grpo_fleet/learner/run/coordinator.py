"""The run's coordinator: the rooms of one run (learner/run/rooms.py) and the two threads that work on them.

`learner/door/server.py` owns the ZeroMQ loop: on the I/O thread it calls
`requests` (learner/run/handlers.py, the handler table), and it runs
`training` (learner/run/training_thread.py, the loop) on the training thread. The two
threads share the rooms under `lock`, and meet at one named hand-off
(learner/records/state.py): intake puts accepted groups in, training takes
batches out. Every room takes and returns plain typed records, so all of it
can be tested without a network.
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
from grpo_fleet.learner.run.handlers import RequestHandlers
from grpo_fleet.learner.run.rooms import RunRooms
from grpo_fleet.learner.run.training_thread import TrainingThread
from grpo_fleet.learner.step.trainer import Trainer
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
                         pub_address=pub_address, eval_prompt_tokens=eval_prompt_tokens, make_scorer=make_scorer,
                         make_envs=make_envs)
        self.requests = RequestHandlers(self)
        self.training = TrainingThread(self)

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
        return self.training.checkpoint()

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        self.training.resume(checkpoint)

    def close(self) -> None:
        self.verification.close()
        self.trackers.close()
        self.runlog.close()
