"""An OpenEnv environment as a `task.env`, in this process (no HTTP server, no container): reset/step as init/step.

    task.env = "grpo_fleet.envs.adapters.openenv_env:OpenEnvEnv"
    task.env_config = {environment = "my_env.server:EchoEnvironment", env_args = {}}

`environment` is the `Environment` subclass as "module:Class", the module
importable by name (installed, or on PYTHONPATH); `env_args` are its constructor's
keyword arguments. One instance per episode.

- init(prompt): `reset()`, with the example's columns that reset takes by name
  (a `seed` column gives each prompt its own seeded episode). The learner's prompt
  opens the conversation, as it rendered it: the reset observation is not shown
  (a message after the prompt's generation header cannot continue its ids), so
  what the model must see first belongs in the dataset's prompt.
- step(text): the model's turn becomes the environment's Action: its one text
  field (or `action_field`) holds the turn. The Action class is the one the class
  declares, `Environment[MyAction, MyObservation, MyState]`, or `action =
  "module:Class"`. The observation's `reward` is the step's reward (None is 0),
  its `done` ends the episode, and its text is the next user message.
- An observation's text is its `observation_field`, else its one text field (the
  fields besides done, reward and metadata), else those fields as JSON.

OpenEnv does not say whether an environment is deterministic, so `OpenEnvEnv`
does not claim it (security.verify_rewards = false); `DeterministicOpenEnvEnv`
says so for you, and the learner replays its episodes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import typing
from typing import Any, Optional

try:
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation
except ImportError as exc:  # one line at start-up, naming the extra
    raise ImportError(f"task.env's OpenEnv adapter needs the openenv-core package: pip install "
                      f"'grpo-fleet[openenv]' ({exc})") from None

from grpo_fleet.envs.protocol import EnvError

CONFIG_KEYS = ("environment", "env_args", "action", "action_field", "observation_field")
OBSERVATION_BOOKKEEPING = {"done", "reward", "metadata"}


def named_class(spec: Any, base: type, what: str) -> type:
    """The class "module:Class" names, a subclass of `base`; EnvError says what is wrong, in one line."""
    module, _, name = str(spec).rpartition(":")
    if not module or not name or module.endswith(".py") or "/" in module:
        raise EnvError(f"task.env_config.{what} = {spec!r}: expected 'package.module:ClassName' (an importable module)")
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type) or not issubclass(cls, base):
        raise EnvError(f"task.env_config.{what} = {spec!r} is not an OpenEnv {base.__name__} subclass")
    return cls


def declared_action(env_class: type) -> Optional[type]:
    """The Action class of `class MyEnv(Environment[MyAction, ...])`, if the class says it."""
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], Action):
                return args[0]
    return None


def text_field(model: Any, wanted: Optional[str], ignored: set[str], what: str) -> Optional[str]:
    """`wanted` if the model has it; else its one `str` field (besides `ignored`); else None."""
    fields = {name: field for name, field in model.model_fields.items() if name not in ignored}
    if wanted is not None:
        if wanted not in fields:
            raise EnvError(f"task.env_config.{what} = {wanted!r}: {model.__name__} has no such field ({sorted(fields)})")
        return wanted
    texts = [name for name, field in fields.items() if field.annotation is str]
    return texts[0] if len(texts) == 1 else None


def observation_text(observation: Any, field: Optional[str]) -> str:
    """What the model reads: the named field, the one text field, or the observation's own fields as JSON."""
    if not isinstance(observation, Observation):
        raise EnvError(f"the OpenEnv environment returned a {type(observation).__name__}, not an Observation")
    if field is not None:
        return str(getattr(observation, field))
    values = observation.model_dump(exclude=OBSERVATION_BOOKKEEPING)
    if not values:
        return ""
    only = next(iter(values.values()))
    return only if len(values) == 1 and isinstance(only, str) else json.dumps(values, default=str)


class OpenEnvEnv:
    """One episode of an OpenEnv environment (see the module docstring); not declared deterministic."""

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None) -> None:
        config, self.extras = dict(env_config or {}), dict(extras or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise EnvError(f"task.env_config for an OpenEnv environment takes {', '.join(CONFIG_KEYS)}, not {unknown}")
        env_class = named_class(config.get("environment"), Environment, "environment")
        if getattr(env_class, "REQUIRES_SINGLE_THREAD_EXECUTOR", False):
            raise EnvError(f"{env_class.__name__} needs every call on one thread (REQUIRES_SINGLE_THREAD_EXECUTOR); the "
                           "environment process runs an episode's calls on any of its worker threads")
        action_class = (named_class(config["action"], Action, "action") if "action" in config
                        else declared_action(env_class))
        if action_class is None:
            raise EnvError(f"{env_class.__name__} does not declare its Action class (Environment[MyAction, ...]): set "
                           "task.env_config.action = 'module:MyAction'")
        action_field = text_field(action_class, config.get("action_field"), {"metadata"}, "action_field")
        if action_field is None:
            raise EnvError(f"{action_class.__name__} has no single text field for the model's turn: set "
                           "task.env_config.action_field")
        self.action_class: Any = action_class
        self.action_field: str = action_field
        self.observation_field: Optional[str] = config.get("observation_field")
        self.env = env_class(**dict(config.get("env_args") or {}))

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        observation = self.env.reset(**self._reset_arguments())
        return list(prompt), {"observation": observation_text(observation, self.observation_field)}

    def step(self, action: str) -> dict[str, Any]:
        observation = self.env.step(self.action_class(**{self.action_field: action}))
        text = observation_text(observation, self.observation_field)
        done = bool(observation.done)
        return {"observations": [] if done or not text else [{"role": "user", "content": text}],
                "reward": float(observation.reward or 0.0), "done": done, "metadata": dict(observation.metadata)}

    def close(self) -> None:
        self.env.close()

    def _reset_arguments(self) -> dict[str, Any]:
        """The example's columns that `reset` names as parameters (seed, episode_id, or its own)."""
        parameters = inspect.signature(self.env.reset).parameters
        named = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return {name: self.extras[name] for name in named if name in self.extras}


class DeterministicOpenEnvEnv(OpenEnvEnv):
    """The same, declared deterministic by you: the learner replays its episodes (security.verify_rewards)."""

    deterministic = True
