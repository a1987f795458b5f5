"""What Welcome tells every actor: the run card (model, sampling, rewards), built once from the run's config."""

from __future__ import annotations

from typing import Optional

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.registry import RunCard
from grpo_fleet.models.loading import Policy
from grpo_fleet.models.zoo import model_reference
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import Task


def run_card(cfg: RunConfig, policy: Policy, task: Task, model_digest: str) -> RunCard:
    """What Welcome tells every actor: the model to load, how to sample, which rewards to score with."""
    return RunCard(
        model=m.ModelRef(path=model_reference(cfg.model.path, policy.path), digest=model_digest,
                         lora=cfg.lora.model_dump() if policy.lora is not None else None, dtype=cfg.model.dtype,
                         chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt),
        generation=m.GenerationParams(**cfg.generation.model_dump()),
        reward=reward_spec(task),
        heartbeat_seconds=cfg.server.heartbeat_seconds, vocab_size=policy.vocab_size, env=env_spec(task),
        max_staleness=cfg.grpo.max_staleness,
    )


def env_spec(task: Task) -> Optional[m.EnvSpec]:
    """task.env as Welcome names it, with the module's digest for actors to check their copy; None without one."""
    from grpo_fleet.tasks.env_module import env_digest

    env = task.env
    if env is None:
        return None
    return m.EnvSpec(module=env.module, class_name=env.class_name, module_digest=env_digest(env.module),
                     config=dict(env.config), max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
                     timeout_seconds=env.timeout_seconds)


def reward_spec(task: Task) -> m.RewardSpec:
    """The run's rewards as Welcome names them, with the reward module's digest for actors to check their copy."""
    from grpo_fleet.tasks.reward_module import module_digest

    module = task.reward_module
    return m.RewardSpec(names=list(task.reward_names), weights=[float(w) for w in task.reward_weights],
                        module=module, module_digest=module_digest(module) if module else None,
                        timeout_seconds=task.reward_timeout_seconds, bound=task.reward_bound)
