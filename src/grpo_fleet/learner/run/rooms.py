"""The rooms of one run, built once from its config: the record they share, the lock over it, and each room.

The run's coordinator (learner/run/coordinator.py) is built on these; its two
named parts, the I/O thread's handler table (learner/run/handlers.py) and the
training thread's loop (learner/run/training_thread.py), each work on them.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.generation import SamplingSettings
from grpo_fleet.learner.door.intake import Intake
from grpo_fleet.learner.door.intake_rules import IntakeRules
from grpo_fleet.learner.door.snapshots import SnapshotStore
from grpo_fleet.learner.door.welcome import run_card
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.fleet.leasing import Leasing
from grpo_fleet.learner.fleet.registry import Registry
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.samples import SampleLog, tokenizer_decode
from grpo_fleet.learner.records.state import BatchHandOff, LearnerState
from grpo_fleet.learner.records.trackers import Trackers
from grpo_fleet.learner.step.gap_bounds import FLOAT32_PAIR_BOUND, CalibratedBounds, compute_dtype, default_bound
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, RewardCheck, WeightHistory
from grpo_fleet.learner.verify.env_replay import EnvCalling, EnvReplay, check_verifiable
from grpo_fleet.learner.verify.gap_calibration import PendingCalibration, calibrate
from grpo_fleet.learner.verify.trust import Trust
from grpo_fleet.metrics import LearnerMetrics
from grpo_fleet.model import Policy
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess


class RunRooms:
    """Single source of truth for the run: leases, accepted groups, steps and versions, under `lock`."""

    def __init__(self, cfg: RunConfig, policy: Policy, trainer: Trainer, task: Task, prompt_tokens: list[np.ndarray],
                 model_digest: str, metrics: LearnerMetrics, run_dir: Path, pub_address: Optional[str] = None,
                 eval_prompt_tokens: Optional[list[np.ndarray]] = None,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess,
                 make_envs: Callable[[EnvSetup], EnvCalling] = EnvProcess) -> None:
        self.cfg, self.policy, self.trainer, self.task = cfg, policy, trainer, task
        self.prompt_tokens, self.model_digest, self.metrics, self.run_dir = prompt_tokens, model_digest, metrics, run_dir
        self.pub_address = pub_address
        self.card = run_card(cfg, policy, task, model_digest)
        scheduler = PromptScheduler(len(prompt_tokens), seed=cfg.train.seed, lease_seconds=cfg.server.lease_seconds)
        self.state = LearnerState(run_id=uuid.uuid4().hex[:12], incarnation=uuid.uuid4().hex[:12],
                                  steps_target=cfg.train.steps, scheduler=scheduler)
        self.lock = threading.RLock()
        self.runlog = RunLog(run_dir)
        self.handoff = BatchHandOff(self.state, self.runlog, self.lock, cfg.grpo.groups_per_step)
        security = cfg.security
        self.trust = Trust(probation_groups=security.probation_groups, share=security.check_share)
        self.registry = Registry(cfg.server, metrics, self.trust, self.state.actor_ids)
        self.leasing = Leasing(cfg, self.state, metrics, prompt_tokens, task.train, self.registry.sessions_of,
                               self.registry.key_count)
        self.snapshots = SnapshotStore(policy, cfg.server.weight_chunk_bytes, metrics)
        # Rewards are re-scored in a process of the learner's own, which can kill a reward that hangs; never
        # in this one, which could not. (Unit tests, which may start no process, pass an in-process scorer.)
        self.make_scorer = make_scorer  # the local evaluator's rewards run in one of these too
        check_verifiable(task.env, cfg.security.verify_rewards)  # before anything starts a process
        replay = env_replay(cfg, task, policy, make_envs)
        self.reward_check = (RewardCheck(task, task.train, policy.tokenizer, make_scorer(task.reward_set()), replay)
                             if cfg.security.verify_rewards else None)
        self.weight_history, self.logprob_check = logprob_check(cfg, policy, metrics)
        learner_dtype = compute_dtype(policy.model)
        # Measured by the training thread as it starts, not here: actors are admitted meanwhile (gap_calibration.py).
        self.calibration = PendingCalibration(
            lambda: calibrate_bounds(cfg, policy, prompt_tokens, learner_dtype) if self.logprob_check is not None else ())
        rules = IntakeRules.from_config(cfg, policy.vocab_size, learner_dtype, self.calibration.bounds,
                                        stop_token_ids=frozenset(int(t) for t in policy.tokenizer.eos_token_ids))
        self.intake = Intake(rules, self.state, self.registry, self.leasing, self.runlog, metrics, prompt_tokens,
                             self.handoff, self.reward_check, self.trust, self.weight_history)
        eval_check = (None if self.reward_check is None
                      else RewardCheck(task, task.eval, policy.tokenizer, self.reward_check.scorer, replay))
        self.evaluation = Evaluation(cfg, task.eval, eval_prompt_tokens or [], policy.vocab_size, self.state,
                                     self.registry, self.runlog, metrics, reward_check=eval_check)
        if self.evaluation.due(0, final=False):
            self.evaluation.start(0, 0)  # the baseline: held-out reward before any training
        self.samples = SampleLog(cfg, tokenizer_decode(policy.tokenizer), self.runlog)
        self.trackers = Trackers([], metrics.tracker_errors)  # setup opens logging.report_to's once the step is known


def env_replay(cfg: RunConfig, task: Task, policy: Policy,
               make_envs: Callable[[EnvSetup], EnvCalling]) -> Optional[EnvReplay]:
    """The replay of a deterministic environment's episodes (security.verify_rewards), in a process of the
    learner's own: the actions an actor reported can make the environment hang, which only a child can be killed
    for (learner/verify/env_replay.py). Unit tests, which may start no process, pass an in-process host."""
    if task.env is None or not cfg.security.verify_rewards:
        return None
    return EnvReplay(task.env, policy.tokenizer, cfg.task.system_prompt, make_envs(task.env),
                     budget_seconds=cfg.security.replay_seconds)


def logprob_check(cfg: RunConfig, policy: Policy,
                  metrics: LearnerMetrics) -> tuple[Optional[WeightHistory], Optional[LogprobCheck]]:
    """security.verify_logprobs: the versions an actor may have sampled from, and the check against them."""
    security = cfg.security
    if not security.verify_logprobs:
        return None, None
    # Every version a buffered group may still train from: up to grpo.max_train_staleness behind the live one.
    max_train_staleness = cfg.grpo.max_train_staleness
    reach = cfg.grpo.max_staleness + cfg.server.in_flight_steps
    history = WeightHistory(policy.model, keep=max(reach, max_train_staleness or 0) + 1)
    history.record(0)
    check = LogprobCheck(policy.model, history, temperature=cfg.generation.temperature,
                         chunk_tokens=cfg.train.logprob_chunk_tokens, micro_batch_tokens=cfg.train.micro_batch_tokens,
                         max_gap=security.max_logprob_gap, observe=metrics.logprob_gap.observe,
                         observe_seconds=metrics.logprob_check_seconds.observe)
    return history, check


def calibrate_bounds(cfg: RunConfig, policy: Policy, prompt_tokens: list[np.ndarray],
                     learner_dtype: str) -> CalibratedBounds:
    """The half-precision bound measured on this model at start (security.calibration_prompts; none when 0).

    Actors sample in model.dtype when it is set, else float32 on a CPU and their
    own (unknown, held to bfloat16's bound) on a GPU: only a half-precision pair
    is calibrated, a float32 one keeps its fixed bound.
    """
    dtype = cfg.model.dtype or "bfloat16"
    count = min(cfg.security.calibration_prompts, len(prompt_tokens))
    ceiling = default_bound(dtype, learner_dtype)
    if count == 0 or ceiling.mean <= FLOAT32_PAIR_BOUND:
        return ()
    settings = calibration_settings(cfg, policy.tokenizer.eos_token_ids)
    # Sampling in the learner's own dtype would show no rounding at all: a half-precision learner is calibrated
    # against float32 sampling, as wide an honest gap as a same-dtype actor on other hardware shows.
    sample_in = "float32" if dtype == learner_dtype else dtype
    found = calibrate(policy.model, prompt_tokens[:count], settings, dtype=sample_in, ceiling=ceiling,
                      chunk_tokens=cfg.train.logprob_chunk_tokens, micro_batch_tokens=cfg.train.micro_batch_tokens)
    return ((dtype, found.bound),)


def calibration_settings(cfg: RunConfig, stop_token_ids: Iterable[int]) -> SamplingSettings:
    """The run's sampling, for completions of at most security.calibration_tokens: the honest gap is per token, and
    sampling 256-token answers in bfloat16 on a CPU made the learner wait 205 s before it admitted any actor."""
    gen = cfg.generation
    return SamplingSettings(group_size=gen.group_size, max_tokens=min(gen.max_tokens, cfg.security.calibration_tokens),
                            temperature=gen.temperature, stop_token_ids=sorted(stop_token_ids))
