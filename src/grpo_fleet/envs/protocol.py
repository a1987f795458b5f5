"""The environment interface: skyrl-gym's, so its environments run unchanged and yours imports nothing from us.

A class named by `task.env = "my_env.py:ClassName"` (or "package.module:ClassName")
is built once per episode and driven like this:

    env = ClassName(env_config, extras)      # env_config: task.env_config (a dict)
                                             # extras: the example's columns, "answer", "max_turns" (task.max_turns)
                                             #         and "reward_spec": {"method": "rule", "ground_truth": answer}
    conversation, info = env.init(prompt)    # prompt: the chat messages the learner's prompt renders
    out = env.step(action_text)              # the model's turn, decoded without its stop token
    out == {"observations": [messages], "reward": float, "done": bool, "metadata": dict}
    env.close()                              # optional

A class attribute `deterministic = True` says the same actions always give the
same observations and rewards: the learner then replays each submitted episode
to check it (security.verify_rewards, learner/verify/env_replay.py). A run that
verifies rewards refuses to start with an environment that does not say so.

The episode's reward is the sum of its steps' rewards. Observations are chat
messages ({"role": "user", "content": ...}); their tokens come from the chat
template, never from re-tokenizing the model's own text (envs/template.py).

This module checks what user code returned, so a wrong shape is one clear error
for that episode, never a crash of the actor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# What one step may give back, bounded: a runaway environment cannot flood the conversation.
MAX_OBSERVATION_MESSAGES = 16
MAX_OBSERVATION_CHARS = 32_768


class TextEnv(Protocol):
    """What an environment provides (duck-typed: nothing to inherit, skyrl-gym's BaseTextEnv fits)."""

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def step(self, action: str) -> Mapping[str, Any]: ...


class EnvError(ValueError):
    """An environment broke the interface (a wrong shape, a bad reward); the episode fails, with this message."""


@dataclass(frozen=True)
class StepResult:
    """One checked step: the observation messages, this step's reward, and whether the episode is over."""

    observations: list[dict[str, Any]]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


def checked_messages(value: Any, what: str) -> list[dict[str, Any]]:
    """A list of {"role": str, "content": str} messages, copied, within the bounds; else EnvError."""
    if not isinstance(value, (list, tuple)):
        raise EnvError(f"{what} must be a list of chat messages, got {type(value).__name__}")
    messages = []
    for message in value:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise EnvError(f"{what}: each message needs a string 'role', got {str(message)[:100]!r}")
        if not isinstance(message.get("content"), str):
            raise EnvError(f"{what}: message content must be a string, got {type(message.get('content')).__name__}")
        messages.append({str(key): item for key, item in message.items()})
    return messages


def checked_step(output: Any) -> StepResult:
    """What `env.step` returned, checked: observations are messages, the reward a finite number, done a bool."""
    if not isinstance(output, Mapping):
        raise EnvError(f"step must return a dict (observations, reward, done, metadata), got {type(output).__name__}")
    observations = checked_messages(output.get("observations", []), "step's observations")
    if len(observations) > MAX_OBSERVATION_MESSAGES:
        raise EnvError(f"step returned {len(observations)} observation messages (at most {MAX_OBSERVATION_MESSAGES})")
    if sum(len(message["content"]) for message in observations) > MAX_OBSERVATION_CHARS:
        raise EnvError(f"step's observations exceed {MAX_OBSERVATION_CHARS} characters")
    reward = output.get("reward", 0.0)
    reward = 0.0 if reward is None else reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise EnvError(f"step's reward must be a finite number, got {reward!r}"[:200])
    done = output.get("done")
    if not isinstance(done, bool):
        raise EnvError(f"step's done must be a bool, got {type(done).__name__}")
    metadata = output.get("metadata") or {}
    return StepResult(observations, float(reward), done, dict(metadata) if isinstance(metadata, Mapping) else {})


def checked_init(output: Any) -> list[dict[str, Any]]:
    """The conversation `env.init` returned (its info is not used)."""
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise EnvError(f"init must return (conversation, info), got {type(output).__name__}")
    conversation = checked_messages(output[0], "init's conversation")
    if not conversation:
        raise EnvError("init returned an empty conversation")
    return conversation


def env_extras(columns: Mapping[str, Any], answer: Any, max_turns: int) -> dict[str, Any]:
    """The `extras` a skyrl-gym environment is built with: the example's columns, its answer as the
    reward spec's ground truth (skyrl-gym's dataset convention), and max_turns (as SkyRL's generator adds)."""
    extras = dict(columns)
    extras["answer"] = answer
    extras["reward_spec"] = {"method": "rule", "ground_truth": answer}
    extras.setdefault("extra_info", {})
    extras["max_turns"] = max_turns
    return extras
