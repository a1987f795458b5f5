"""The rooms of one run, built once from its config: the record they share, the lock over it, and each room.

The run's coordinator (learner/run/coordinator.py) is built on these; it hands each of its parts, the I/O
thread's handler table (learner/run/handlers.py), the training thread's loop (learner/run/training_thread.py),
its checkpoints and its local evaluator, the few rooms that part works on, by name.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.learner.actors.leasing import Leasing
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.intake import Intake
from grpo_fleet.learner.door.intake_rules import IntakeRules
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.door.welcome import run_card
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.samples import SampleLog, tokenizer_decode
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.records.trackers import Trackers
from grpo_fleet.learner.step.gap_bounds import compute_dtype
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.env_replay import EnvCalling
from grpo_fleet.learner.verify.verification import Verification
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess


class RunRooms:
    """Single source of truth for the run: leases, accepted groups, steps and versions, under `lock`."""

    def __init__(self, cfg: RunConfig, policy: Policy, trainer: Trainer, task: Task, prompt_tokens: list[np.ndarray],
                 model_digest: str, metrics: LearnerMetrics, run_dir: Path,
                 eval_prompt_tokens: Optional[list[np.ndarray]] = None,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess,
                 make_envs: Callable[[EnvSetup], EnvCalling] = EnvProcess) -> None:
        self.cfg, self.policy, self.trainer, self.task = cfg, policy, trainer, task
        self.prompt_tokens, self.model_digest, self.metrics, self.run_dir = prompt_tokens, model_digest, metrics, run_dir
        self.card = run_card(cfg, policy, task, model_digest)
        scheduler = PromptScheduler(len(prompt_tokens), seed=cfg.train.seed, lease_seconds=cfg.server.lease_seconds)
        self.state = LearnerState(run_id=uuid.uuid4().hex[:12], incarnation=uuid.uuid4().hex[:12],
                                  steps_target=cfg.train.steps, scheduler=scheduler)
        self.lock = threading.RLock()
        self.runlog = RunLog(run_dir)
        self.handoff = BatchHandOff(self.state, self.runlog, self.lock, cfg.grpo.groups_per_step)
        learner_dtype = compute_dtype(policy.model)
        self.verification = Verification.build(cfg, task, policy, prompt_tokens, metrics, learner_dtype, make_scorer,
                                               make_envs)
        verification = self.verification
        self.registry = Registry(cfg.server, metrics, verification.trust, self.state.actor_ids)
        self.leasing = Leasing(cfg, self.state, metrics, prompt_tokens, task.train, self.registry.sessions_of,
                               self.registry.key_count)
        self.snapshots = SnapshotStore(policy, cfg.server.weight_chunk_bytes, metrics)
        self.make_scorer = make_scorer  # the local evaluator's rewards run in one of these too
        stop = frozenset(int(t) for t in policy.tokenizer.eos_token_ids)
        rules = IntakeRules.from_config(cfg, policy.vocab_size, stop_token_ids=stop)
        self.intake = Intake(rules, self.state, self.registry, self.leasing, self.runlog, metrics, prompt_tokens,
                             self.handoff, verification)
        self.evaluation = Evaluation(cfg, task.eval, eval_prompt_tokens or [], policy.vocab_size, self.state,
                                     self.registry, self.runlog, metrics, reward_check=verification.eval_check)
        if self.evaluation.due(0, final=False):
            self.evaluation.start(0, 0)  # the baseline: held-out reward before any training
        self.samples = SampleLog(cfg, tokenizer_decode(policy.tokenizer), self.runlog)
        self.trackers = Trackers([], metrics.tracker_errors)  # setup opens logging.report_to's once the step is known

