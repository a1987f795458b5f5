"""The actor's episodes (Welcome.env): admit the environment, run a lease's episodes, score them for the wire.

The environment runs in a child process of its own (envs/process.py), started on
admission from this machine's copy of the learner's module (same digest, as with
reward modules). A lease's prompts become episodes (envs/runner.py); each
completion's reward is its episode's, plus the task's rewards when the run names
any (scored on the episode's text after the prompt, both kinds of tokens). A group
with a failed episode or a failed reward goes back unscored, never half scored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional

from grpo_fleet.actor import wire
from grpo_fleet.actor.admission import ActorRefused, model_path_allowed
from grpo_fleet.actor.rewarding import RunRewards, scoring_jobs
from grpo_fleet.envs.process import EnvProcess, EnvsRefused
from grpo_fleet.envs.protocol import env_extras
from grpo_fleet.envs.runner import EpisodeLimits, EpisodeOutcome, EpisodeRunner, EpisodeStart
from grpo_fleet.models.generation import SamplingSettings
from grpo_fleet.models.loading import Policy
from grpo_fleet.observe.metrics import ActorMetrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup, env_digest
from grpo_fleet.tasks.prompts import chat_messages
from grpo_fleet.tasks.reward_module import is_module_name
from grpo_fleet.tasks.scoring import GroupScore

log = logging.getLogger("grpo_fleet.actor")
ENV_REWARD = "env"  # the `reward` an unscored group names when its environment failed


def plan_env(spec: m.EnvSpec, model_dirs: list[str], concurrency: int = 64) -> EnvSetup:
    """This machine's copy of the learner's environment, once it has the learner's digest.

    Importing runs code, so a file must lie inside an allowed --model-dir (the
    working directory by default); a module name is one already installed here.
    """
    if not is_module_name(spec.module) and not model_path_allowed(spec.module, model_dirs):
        raise ActorRefused(f"the learner's environment {spec.module!r} is outside the allowed directories "
                           f"{model_dirs or ['.']}: keep this machine's copy inside a --model-dir")
    try:
        digest = env_digest(spec.module)
    except EnvLoadError as exc:
        raise ActorRefused(f"this actor cannot read the learner's environment: {exc}") from exc
    if digest != spec.module_digest:
        raise ActorRefused(f"environment {spec.module!r} differs from the learner's (digest {digest[:12]} vs "
                           f"{spec.module_digest[:12]}): give every Mac the same file")
    return EnvSetup(module=spec.module, class_name=spec.class_name, config=dict(spec.config),
                    max_turns=spec.max_turns, max_episode_tokens=spec.max_episode_tokens,
                    timeout_seconds=spec.timeout_seconds, concurrency=concurrency)


def episode_starts(lease: m.Lease, welcome: m.Welcome, env: m.EnvSpec) -> list[EpisodeStart]:
    """Each prompt's ids, the conversation they render (what env.init gets) and the environment's extras."""
    starts = []
    for item in lease.prompts:
        messages = ([dict(message) for message in item.messages] if item.messages is not None
                    else chat_messages(item.prompt_text, welcome.model.system_prompt))
        columns = {key: value for key, value in item.fields.items() if key != "answer"}
        starts.append(EpisodeStart(prompt_tokens=item.prompt_tokens.to_numpy().tolist(), messages=messages,
                                   extras=env_extras(columns, item.fields.get("answer"), env.max_turns)))
    return starts


class RunEpisodes:
    """The run's environment process: started on admission, restarted when the run's environment changes."""

    def __init__(self) -> None:
        self.setup: Optional[EnvSetup] = None
        self.process: Optional[EnvProcess] = None

    def start(self, spec: Optional[m.EnvSpec], model_dirs: list[str], concurrency: int = 64) -> None:
        setup = plan_env(spec, model_dirs, concurrency) if spec is not None else None
        if setup == self.setup and (setup is None or self.process is not None):
            return
        self.close()
        if setup is not None:
            try:
                self.process = EnvProcess(setup)
            except EnvsRefused as exc:
                raise ActorRefused(f"this actor cannot run the learner's environment: {exc}") from exc
        self.setup = setup

    def rollout(self, lease: m.Lease, welcome: m.Welcome, policy: Policy, settings: SamplingSettings,
                rewards: RunRewards, metrics: ActorMetrics,
                beat: Callable[[], None]) -> tuple[list[m.GroupResult], list[m.UnscoredGroup]]:
        """Run the lease's episodes and score them."""
        assert welcome.env is not None and self.process is not None  # admission started it
        limits = EpisodeLimits(welcome.env.max_turns, welcome.env.max_episode_tokens)
        runner = EpisodeRunner(policy.model, policy.tokenizer, settings, limits, self.process, on_step=beat)
        groups = runner.run(episode_starts(lease, welcome, welcome.env))
        return score_episodes(lease.prompts, groups, rewards, policy.tokenizer, metrics)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
        self.process, self.setup = None, None


def score_episodes(items: Sequence[m.PromptItem], groups: Sequence[Sequence[EpisodeOutcome]], rewards: RunRewards,
                   tokenizer: Any, metrics: ActorMetrics) -> tuple[list[m.GroupResult], list[m.UnscoredGroup]]:
    """Scored groups (episode reward + the task's rewards) and the ones an environment or a reward failed on."""
    scored, unscored = [], []
    task_scores = _task_scores(items, groups, rewards, tokenizer)
    for item, outcomes, score in zip(items, groups, task_scores):
        _observe(outcomes, metrics)
        failed = next((o.failure for o in outcomes if o.failure is not None), None)
        if failed is not None:
            metrics.reward_errors.labels(reward=ENV_REWARD, error=failed.kind).inc()
            unscored.append(_unscored(item.group_id, ENV_REWARD, failed.kind, failed.detail))
            continue
        totals = [o.reward for o in outcomes]
        if score is not None and score.rewards is None:
            failure = score.failure
            assert failure is not None  # a GroupScore has rewards or a failure
            metrics.reward_errors.labels(reward=failure.reward, error=str(failure.error)).inc()
            unscored.append(_unscored(item.group_id, failure.reward, str(failure.error), failure.detail))
            continue
        if score is not None and score.rewards is not None:
            totals = [total + task for total, task in zip(totals, score.rewards)]
        bound = rewards.rewards.bound if rewards.rewards is not None else m.FLOAT32_MAX
        if any(abs(total) > bound for total in totals):
            unscored.append(_unscored(item.group_id, ENV_REWARD, "out_of_bounds", f"an episode's reward is beyond "
                                      f"+-{bound:g} (task.reward_bound)"))
            continue
        for total in totals:
            metrics.reward.observe(total)
        scored.append(wire.to_group(item.group_id, [o.completion for o in outcomes], totals))
    return scored, unscored


def _task_scores(items: Sequence[m.PromptItem], groups: Sequence[Sequence[EpisodeOutcome]], rewards: RunRewards,
                 tokenizer: Any) -> list[Optional[GroupScore]]:
    """The task's rewards on each group's episodes (None where the run names none or the group failed)."""
    if rewards.scorer is None or rewards.rewards is None or not rewards.rewards.names:
        return [None] * len(items)
    ok = [i for i, outcomes in enumerate(groups) if all(o.failure is None for o in outcomes)]
    jobs = scoring_jobs([items[i] for i in ok], [[o.completion for o in groups[i]] for i in ok], tokenizer)
    found: list[Optional[GroupScore]] = [None] * len(items)
    for index, score in zip(ok, rewards.scorer.score(jobs)):
        found[index] = score
    return found


def _unscored(group_id: str, reward: str, error: str, detail: str) -> m.UnscoredGroup:
    log.warning("group %s unscored: %s %s: %s", group_id, shown(reward), error, shown(detail, 300))
    return m.UnscoredGroup(group_id=group_id, reward=shown(reward, 64)[:64], error=shown(error, 64)[:64],
                           detail=shown(detail, 1000)[:4096])


def _observe(outcomes: Sequence[EpisodeOutcome], metrics: ActorMetrics) -> None:
    """Sampled tokens only count as generated: environment tokens were not decoded by the model."""
    for outcome in outcomes:
        metrics.env_seconds.observe(outcome.env_seconds)
        marks = outcome.completion.episode
        if marks is None or outcome.failure is not None:
            continue
        sampled = sum(marks.mask)
        metrics.tokens_generated.inc(sampled)
        metrics.episode_tokens.labels(kind="sampled").inc(sampled)
        metrics.episode_tokens.labels(kind="environment").inc(len(marks.mask) - sampled)
        metrics.episode_turns.observe(outcome.turns)
        metrics.episodes_ended.labels(end=marks.end).inc()
    metrics.groups_generated.inc()
