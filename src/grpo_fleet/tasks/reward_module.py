"""A user's own rewards: `task.reward_module` names a Python file or an importable module.

Its functions become rewards either by the project's decorator
(`@register_reward` or `@register_reward("name")` from `grpo_fleet.tasks`) or by
being named in `task.rewards` (module attributes are looked up by name after the
registry). Every actor runs its own copy; the learner sends the copy's BLAKE3
digest in Welcome and an actor whose copy differs refuses the run. No code
crosses the wire.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Optional

import blake3

from grpo_fleet.tasks.rewards import REWARDS, RewardFn, UnknownRewardError

# A dotted Python module name; anything else (a ".py" suffix, a slash) is a file path.
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class RewardModuleError(ValueError):
    """The reward module cannot be found, read or imported, or does not define a named reward."""


def is_module_name(spec: str) -> bool:
    return bool(MODULE_NAME.match(spec)) and not spec.endswith(".py")


def canonical_spec(spec: str) -> str:
    """A file path made absolute (what Welcome names), or the module name as given."""
    return spec if is_module_name(spec) else str(Path(spec).expanduser().resolve())


def source_files(spec: str) -> list[Path]:
    """The files whose bytes make up the module: the file, or a package's every .py file, sorted."""
    if not is_module_name(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise RewardModuleError(f"task.reward_module = {spec!r}: no such file")
        return [path]
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError) as exc:
        raise RewardModuleError(f"task.reward_module = {spec!r}: {exc}") from exc
    if found is None or found.origin is None or not Path(found.origin).is_file():
        raise RewardModuleError(f"task.reward_module = {spec!r}: no importable module by that name (or no source file)")
    if found.submodule_search_locations:
        root = Path(found.origin).parent
        return sorted(root.rglob("*.py"))
    return [Path(found.origin)]


def module_digest(spec: str) -> str:
    """BLAKE3 of the module's source: a file's bytes (its name may differ per Mac), or a package's every
    file under its path relative to the package."""
    files = source_files(spec)
    if len(files) == 1 and not (is_module_name(spec) and files[0].name == "__init__.py"):
        return str(blake3.blake3(files[0].read_bytes()).hexdigest())
    root = Path(os.path.commonpath(files))  # the package directory: its __init__.py is among the files
    hasher = blake3.blake3()
    for path in files:
        data = path.read_bytes()
        hasher.update(f"{path.relative_to(root)}\0{len(data)}\0".encode())
        hasher.update(data)
    return str(hasher.hexdigest())


def load_module(spec: str) -> ModuleType:
    """Import the module (its decorators register its rewards); errors say what failed."""
    try:
        if is_module_name(spec):
            return importlib.import_module(spec)
        path = Path(spec).expanduser().resolve()
        name = f"grpo_fleet_user_rewards_{blake3.blake3(str(path).encode()).hexdigest()[:12]}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardModuleError(f"task.reward_module = {spec!r}: not a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    except RewardModuleError:
        raise
    except Exception as exc:  # the user's code: any error at import is theirs to see, named
        raise RewardModuleError(f"importing reward module {spec!r} failed: {type(exc).__name__}: {exc}") from exc


def resolve_rewards(names: Sequence[str], module: Optional[ModuleType]) -> list[RewardFn]:
    """The function behind each name: the registry first, then the module's attribute of that name."""
    functions = []
    for name in names:
        fn = REWARDS.get(name)
        if fn is None and module is not None:
            candidate = getattr(module, name, None)
            fn = candidate if callable(candidate) else None
        if fn is None:
            extra = f" (nor is it a function in {module.__name__})" if module is not None else ""
            raise UnknownRewardError(name, extra)
        functions.append(fn)
    return functions


def load_rewards(names: Sequence[str], module_spec: Optional[str]) -> list[RewardFn]:
    """Import the reward module, if any, and resolve every name."""
    module = load_module(module_spec) if module_spec else None
    return resolve_rewards(names, module)
