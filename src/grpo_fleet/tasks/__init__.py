"""Tasks: the prompts a run trains on and how completions are scored.

The learner builds a `Task` from its `TaskConfig`. Actors never see the Task
itself: each prompt travels with `Task.fields(example)` and the run's reward
names and weights, and actors call `score_completion` with those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from grpo_fleet.tasks.rewards import REWARDS, RewardFn, UnknownRewardError, get_reward, register_reward

if TYPE_CHECKING:
    from grpo_fleet.config import TaskConfig

__all__ = [
    "BUILTIN_PREFIX",
    "Example",
    "REWARDS",
    "RewardFn",
    "Task",
    "UnknownRewardError",
    "build_task",
    "data_path",
    "get_reward",
    "register_reward",
    "resolve_task_path",
    "score_completion",
    "validate_rewards",
]

DATA_DIR = Path(__file__).parent / "data"
# A task path "builtin:gsm8k_mini" names a file shipped in DATA_DIR, so configs
# need not know where the package is installed.
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class Example:
    """One prompt (raw user text, before any chat template) and its reference answer."""

    prompt: str
    answer: str


def validate_rewards(reward_names: Sequence[str], reward_weights: Optional[Sequence[float]] = None) -> list[float]:
    """Check every reward name exists and weights line up; return the weights (default all 1.0)."""
    for name in reward_names:
        get_reward(name)
    if reward_weights is None:
        return [1.0] * len(reward_names)
    if len(reward_weights) != len(reward_names):
        raise ValueError(
            f"{len(reward_weights)} reward weights for {len(reward_names)} rewards ({list(reward_names)}); "
            "give one weight per reward"
        )
    return [float(weight) for weight in reward_weights]


def score_completion(
    reward_names: Sequence[str],
    reward_weights: Optional[Sequence[float]],
    completion_text: str,
    fields: dict[str, str],
) -> float:
    """Weighted sum of the named rewards for one completion (weights default to 1.0)."""
    weights = validate_rewards(reward_names, reward_weights)
    return sum(weight * get_reward(name)(completion_text, fields) for name, weight in zip(reward_names, weights))


@dataclass(frozen=True)
class Task:
    """Train and eval examples plus the rewards that score completions."""

    name: str
    train: list[Example]
    eval: list[Example]
    reward_names: list[str]
    reward_weights: list[float]

    def fields(self, example: Example) -> dict[str, str]:
        """What travels to actors alongside a prompt so they can score completions."""
        return {"answer": example.answer}

    def score(self, completion_text: str, example_fields: dict[str, str]) -> float:
        """Weighted sum of this task's rewards for one completion."""
        return score_completion(self.reward_names, self.reward_weights, completion_text, example_fields)


def data_path(name: str) -> Path:
    """Path of a data file shipped with the package, e.g. data_path("gsm8k_mini.jsonl")."""
    for candidate in (DATA_DIR / name, DATA_DIR / f"{name}.jsonl"):
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(path.name for path in DATA_DIR.glob("*.jsonl"))) or "(none)"
    raise FileNotFoundError(f"no bundled data file {name!r}; available: {available}")


def resolve_task_path(path: str) -> Path:
    """A task file path, where "builtin:NAME" means a file shipped with the package."""
    if path.startswith(BUILTIN_PREFIX):
        return data_path(path[len(BUILTIN_PREFIX) :])
    return Path(path).expanduser()


def build_task(cfg: "TaskConfig") -> Task:
    """The Task a TaskConfig describes; reward names are checked before any data is loaded."""
    weights = validate_rewards(cfg.rewards, cfg.reward_weights)
    if cfg.name == "reverse":
        train, eval_examples = _reverse_splits(cfg)
    elif cfg.name == "jsonl":
        train, eval_examples = _jsonl_splits(cfg)
    else:
        raise ValueError(f"unknown task {cfg.name!r}; known tasks: jsonl, reverse")
    return Task(
        name=cfg.name,
        train=train,
        eval=eval_examples,
        reward_names=list(cfg.rewards),
        reward_weights=weights,
    )


def _reverse_splits(cfg: "TaskConfig") -> tuple[list[Example], list[Example]]:
    # Imported here because reverse.py imports Example from this module.
    from grpo_fleet.tasks.reverse import make_reverse_splits

    return make_reverse_splits(cfg.num_train, cfg.num_eval, cfg.digits, cfg.seed)


def _jsonl_splits(cfg: "TaskConfig") -> tuple[list[Example], list[Example]]:
    """Train from train_path; eval from eval_path (first num_eval) or held out from train's tail."""
    from grpo_fleet.tasks.jsonl import load_jsonl

    if not cfg.train_path:
        raise ValueError("task 'jsonl' needs train_path")
    train_file = resolve_task_path(cfg.train_path)
    train = load_jsonl(train_file)
    if not train:
        raise ValueError(f"{train_file}: no examples")
    if cfg.eval_path is not None:
        return train, load_jsonl(resolve_task_path(cfg.eval_path))[: cfg.num_eval]
    # Hold out at most half so a small file still leaves most of it for training.
    held_out = min(cfg.num_eval, len(train) // 2)
    if held_out == 0:
        raise ValueError(
            f"{train_file}: only {len(train)} example(s), too few to hold out an eval split; give eval_path"
        )
    return train[:-held_out], train[-held_out:]
