"""The run's coordinator: the rooms of one run (learner/run/rooms.py) and the two threads that work on them.

`learner/door/server.py` owns the ZeroMQ loop and calls `handle()` on the I/O
thread, whose handler table is learner/run/handlers.py; it runs `train_until()`
on the training thread, whose loop is learner/run/training_thread.py. The two
threads share the rooms under `lock`, and meet at one named hand-off
(learner/records/handoff.py): intake puts accepted groups in, training takes
batches out. Every room takes and returns plain typed records, so all of it
can be tested without a network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
from pydantic import BaseModel

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.fleet.bans import peer_key
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.run.handlers import RequestHandlers
from grpo_fleet.learner.run.rooms import RunRooms
from grpo_fleet.learner.run.training_thread import TrainingThread
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.metrics import LearnerMetrics
from grpo_fleet.model import Policy
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import ProtocolError
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess


class RunCoordinator(RunRooms):
    """The run's rooms, with the I/O thread's `requests` and the training thread's `training`."""

    def __init__(self, cfg: RunConfig, policy: Policy, trainer: Trainer, task: Task, prompt_tokens: list[np.ndarray],
                 model_digest: str, metrics: LearnerMetrics, run_dir: Path, pub_address: Optional[str] = None,
                 eval_prompt_tokens: Optional[list[np.ndarray]] = None,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess) -> None:
        super().__init__(cfg, policy, trainer, task, prompt_tokens, model_digest, metrics, run_dir,
                         pub_address=pub_address, eval_prompt_tokens=eval_prompt_tokens, make_scorer=make_scorer)
        self.requests = RequestHandlers(self)
        self.training = TrainingThread(self)

    # ------------------------------------------------------------------ requests (I/O thread)

    def handle(self, identity: bytes, msg: BaseModel | ProtocolError, principal: Optional[str] = None,
               peer_address: str = "", *, observer: bool = False) -> Reply:
        """Answer one decoded message (or a decoding failure) from `identity`.

        `principal` is the authenticated CURVE key; leases are bound to it, so a
        peer reusing another actor's routing id cannot act for it. An `observer`
        key (`keys add-observer`) may ask Status and nothing else.
        """
        with self.lock:
            return self.requests.answer(identity, msg, principal, peer_address, observer=observer)

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
            owner = self.requests.rollouts_owner(msg.lease_id)
            jobs = owner.reward_jobs(actor, msg) if actor is not None else []
            check = owner.reward_check
        if check is None or not jobs:
            return self.handle(identity, msg, principal, peer_address)
        check.score_ahead(jobs)
        try:
            return self.handle(identity, msg, principal, peer_address)
        finally:
            check.forget_ahead()

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

    def train_until(self, should_stop: Callable[[], bool]) -> None:
        """The training thread's loop (learner/run/training_thread.py)."""
        self.training.run(should_stop)

    def ready_to_train(self) -> bool:
        return self.training.ready()

    def wait_for_batch(self, timeout: float) -> bool:
        """Block the training thread until a batch is buffered (or `timeout` passes)."""
        return self.training.wait_for_batch(timeout)

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
        if self.reward_check is not None:
            self.reward_check.close()
        self.trackers.close()
        self.runlog.close()
