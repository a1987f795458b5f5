"""A task's environment (envs/): finding the user's class, `task.env = "my_env.py:ClassName"` or `"package.module:ClassName"`.

The module part is read like `task.reward_module` (tasks/reward_module.py): a
file path or an importable module, whose BLAKE3 digest the learner sends in
Welcome and every actor checks against its own copy. No code crosses the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from grpo_fleet.tasks.reward_module import RewardModuleError, canonical_spec, load_module, module_digest

CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvLoadError(ValueError):
    """The environment cannot be found, read or imported, or is not a class with init and step."""


@dataclass(frozen=True)
class EnvSetup:
    """What an episode's environment is built from on this machine (picklable: it crosses to the child process)."""

    module: str  # this machine's copy: an absolute file path or a module name
    class_name: str
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    max_turns: int = 4
    max_episode_tokens: int = 1024
    timeout_seconds: float = 10.0
    concurrency: int = 64  # calls run at once in the environment process (envs/pool.py)


def split_env_spec(spec: str) -> tuple[str, str]:
    """("my_env.py", "ClassName") from "my_env.py:ClassName"; the class is after the last colon."""
    module, sep, class_name = spec.rpartition(":")
    if not sep or not module or not CLASS_NAME.match(class_name):
        raise EnvLoadError(f"task.env = {spec!r}: expected 'my_env.py:ClassName' or 'package.module:ClassName'")
    return module, class_name


def canonical_env(spec: str) -> tuple[str, str]:
    """The module as Welcome names it (a file made absolute) and the class name."""
    module, class_name = split_env_spec(spec)
    return canonical_spec(module), class_name


def env_digest(module: str) -> str:
    """BLAKE3 of the environment module's source (the same digest as a reward module's)."""
    try:
        return module_digest(module)
    except RewardModuleError as exc:
        raise EnvLoadError(str(exc).replace("task.reward_module", "task.env")) from exc


def load_env_class(module: str, class_name: str) -> type:
    """Import the module and return the class; errors say what failed, in the user's terms."""
    try:
        loaded = load_module(module)
    except RewardModuleError as exc:
        raise EnvLoadError(str(exc).replace("reward module", "environment module")) from exc
    cls = getattr(loaded, class_name, None)
    if not isinstance(cls, type):
        raise EnvLoadError(f"task.env: {module} has no class {class_name!r}")
    missing = [name for name in ("init", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise EnvLoadError(f"task.env: {class_name} has no {' or '.join(missing)} method (see grpo_fleet.envs.protocol)")
    return cls
