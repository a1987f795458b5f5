"""One run's verification, built once from its config: the one thing intake and the training thread are handed.

`Verification.build` reads security.* and makes each part the run needs (none
of a part that is off): the reward re-scoring (with the replay of a
deterministic environment) for training and for eval rounds, the kept versions
and the logprob check against them, the calibration of the half-precision
bound, and the trust that says which groups are checked. The learner's rooms
(learner/run/rooms.py) hold one, and pass it down; the parts do the work
(learner/verify/__init__.py says what each judges, when, and at what cost).

Intake asks it one thing per Rollouts, `judge`: the reward check's verdicts on
the groups it would accept, the actor's honest logprob bound, and which of those
groups the logprob check will recompute, in one typed answer (`Judgement`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.step.gap_bounds import FLOAT32_PAIR_BOUND, CalibratedBounds, GapBound, default_bound
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, RewardCheck, WeightHistory
from grpo_fleet.learner.verify.env_replay import EnvCalling, EnvReplay, check_verifiable
from grpo_fleet.learner.verify.gap_calibration import HonestBounds, PendingCalibration, calibrate
from grpo_fleet.learner.verify.trust import Trust
from grpo_fleet.models.generation import SamplingSettings
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import LearnerMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer


@dataclass(frozen=True)
class Judgement:
    """What verify/ says of the groups of one Rollouts that intake would accept (`Verification.judge`)."""

    verdicts: dict[str, Optional[RejectReason]]  # the reward check's: group_id -> why refused, or None (it agrees)
    bound: GapBound  # the honest logprob gap of the actor's dtype pair, which each informative group is held to
    flagged: frozenset[str]  # the groups the logprob check recomputes before they train, whatever their version

    def refusals(self) -> dict[str, RejectReason]:
        return {group_id: reason for group_id, reason in self.verdicts.items() if reason is not None}


@dataclass
class Verification:
    """Everything that judges actors in one run; a part is None when its check is off (`Verification()`: all off,
    and a trust with no record of anyone, which flags every group)."""

    # Which groups the logprob check looks at: probation, then a random share.
    trust: Trust = field(default_factory=lambda: Trust(probation_groups=0, share=1.0))
    # The half-precision bound, measured on this model by the training thread (none measured: the fixed ceilings).
    calibration: PendingCalibration = field(default_factory=lambda: PendingCalibration(lambda: ()))
    bounds: HonestBounds = field(default_factory=HonestBounds)  # the honest gap each actor is held to
    reward_check: Optional[RewardCheck] = None  # training groups re-scored (security.verify_rewards)
    eval_check: Optional[RewardCheck] = None  # eval rounds' groups, by the same scorer and replay
    history: Optional[WeightHistory] = None  # the versions a group may claim (security.verify_logprobs)
    logprob_check: Optional[LogprobCheck] = None  # a group's logprobs against its claimed version's

    @classmethod
    def build(cls, cfg: RunConfig, task: Task, policy: Policy, prompt_tokens: list[np.ndarray],
              metrics: LearnerMetrics, learner_dtype: str, make_scorer: Callable[[RewardSet], Scorer],
              make_envs: Callable[[EnvSetup], EnvCalling]) -> Verification:
        """The run's checks. Rewards are re-scored in a process of the learner's own, which can kill a reward that
        hangs (unit tests, which may start no process, pass an in-process scorer and environment host)."""
        security = cfg.security
        trust = Trust(probation_groups=security.probation_groups, share=security.check_share)
        check_verifiable(task.env, security.verify_rewards)  # before anything starts a process
        replay = env_replay(cfg, task, policy, make_envs)
        reward_check = eval_check = None
        if security.verify_rewards:
            reward_check = RewardCheck(task, task.train, policy.tokenizer, make_scorer(task.reward_set()), replay)
            eval_check = RewardCheck(task, task.eval, policy.tokenizer, reward_check.scorer, replay)
        history, check = logprob_check(cfg, policy, metrics)
        # Measured by the training thread as it starts, not here: actors are admitted meanwhile (gap_calibration.py).
        calibration = PendingCalibration(
            lambda: calibrate_bounds(cfg, policy, prompt_tokens, learner_dtype) if check is not None else ())
        bounds = HonestBounds(requested_dtype=cfg.model.dtype, learner_dtype=learner_dtype,
                              calibrated=calibration.bounds)
        return cls(trust, calibration, bounds, reward_check, eval_check, history, check)

    def judge(self, key: str, backend: str, groups: Sequence[tuple[m.GroupResult, int]]) -> Judgement:
        """The verdicts on `groups` (each with its prompt index) of one Rollouts from actor key `key` on `backend`,
        which intake would accept (intake, under the lock; the rewards were usually scored ahead, outside it).

        Rewards are re-scored (security.verify_rewards). Each group the rewards
        pass is flagged for the logprob check or not: every group of an actor on
        probation; after it, a share drawn from the OS's randomness (trust.py), so
        an actor cannot tell which of its groups will be looked at. A group at
        the version the step trains from is checked anyway, inside the step,
        whatever its flag.
        """
        verdicts = {} if self.reward_check is None or not groups else self.reward_check.verdicts(groups)
        passed = [group.group_id for group, _ in groups if verdicts.get(group.group_id) is None]
        return Judgement(verdicts, self.bounds.of(backend),
                         frozenset(group_id for group_id in passed if self.trust.wants_check(key)))

    def kept_versions(self) -> Optional[Collection[int]]:
        """The versions whose weights the logprob check still holds, as a live view (it follows the versions as they
        are recorded and dropped, so a holder reads it without asking again); None when the check is off."""
        return None if self.history is None else self.history.versions.keys()

    def close(self) -> None:
        """End the reward process and the replay's child (the eval check shares them)."""
        if self.reward_check is not None:
            self.reward_check.close()


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
