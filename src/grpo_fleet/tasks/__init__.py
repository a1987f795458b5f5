"""Tasks: the prompts a run trains on and how completions are scored.

The learner builds a `Task` from its `TaskConfig`. Actors never see the Task
itself: each prompt travels with `Task.reward_kwargs(example)` and its prompt
text, the run's rewards travel as names, weights and the reward module's
digest, and actors score with `tasks.reward_runner` (tasks/scoring.py is the
policy for rewards that fail).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from grpo_fleet.tasks.examples import BUILTIN_PREFIX, Example, data_path, resolve_task_path
from grpo_fleet.tasks.prompts import Prompt
from grpo_fleet.tasks.reverse import make_reverse_splits
from grpo_fleet.tasks.rewards import REWARDS, RewardFn, UnknownRewardError, get_reward, register_reward
from grpo_fleet.tasks.scoring import ScoringJob

# Registers the `reasoning_gym` reward (the package itself is imported only when used).
from grpo_fleet.tasks import reasoning_gym as _reasoning_gym  # noqa: F401,E402  isort: skip

if TYPE_CHECKING:
    from grpo_fleet.config import TaskConfig
    from grpo_fleet.tasks.env_module import EnvSetup
    from grpo_fleet.tasks.reward_runner import RewardSet

__all__ = [
    "BUILTIN_PREFIX",
    "Example",
    "Prompt",
    "REWARDS",
    "RewardFn",
    "Task",
    "UnknownRewardError",
    "build_task",
    "data_path",
    "get_reward",
    "register_reward",
    "prompt_text",
    "resolve_task_path",
    "validate_rewards",
]

# Reward keyword arguments that would collide with the positional (completion, prompt).
RESERVED_COLUMNS = ("completion", "prompt")


def validate_rewards(reward_names: Sequence[str], reward_weights: Optional[Sequence[float]] = None,
                     module: Optional[str] = None) -> list[float]:
    """Check every reward name exists (importing the reward module, if any) and weights line up; return the weights."""
    from grpo_fleet.tasks.reward_module import load_rewards

    load_rewards(reward_names, module)
    if reward_weights is None:
        return [1.0] * len(reward_names)
    if len(reward_weights) != len(reward_names):
        raise ValueError(
            f"{len(reward_weights)} reward weights for {len(reward_names)} rewards ({list(reward_names)}); "
            "give one weight per reward"
        )
    return [float(weight) for weight in reward_weights]


def prompt_text(prompt: Prompt) -> str:
    """The prompt a reward sees: the text as given, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [str(message.get("content", "")) for message in prompt if message.get("role") == "user"]
    return users[-1] if users else ""


def reward_kwargs(example: Example) -> dict[str, Any]:
    """The keyword arguments every reward gets: the example's columns, then `answer` (the reference answer).

    A column named like a positional argument (`completion`, `prompt`) travels
    as `dataset_completion` / `dataset_prompt` instead.
    """
    kwargs = {f"dataset_{name}" if name in RESERVED_COLUMNS else name: value for name, value in example.columns.items()}
    kwargs["answer"] = example.answer
    return kwargs


@dataclass(frozen=True)
class Task:
    """Train and eval examples plus the rewards that score completions."""

    name: str
    train: list[Example]
    eval: list[Example]
    reward_names: list[str]
    reward_weights: list[float]
    reward_module: Optional[str] = None  # canonical: an absolute file path or a module name
    reward_timeout_seconds: float = 10.0
    reward_bound: float = 1e4
    env: Optional["EnvSetup"] = None  # task.env: every prompt is an episode (envs/); its module canonical

    def fields(self, example: Example) -> dict[str, Any]:
        """What travels to actors alongside a prompt so they can score completions (reward_kwargs)."""
        return reward_kwargs(example)

    def job(self, example: Example, completions: Sequence[str]) -> ScoringJob:
        """One group of completions of `example`, ready to score."""
        return ScoringJob(prompt=prompt_text(example.prompt), columns=reward_kwargs(example), completions=completions)

    def reward_set(self) -> "RewardSet":
        """The run's rewards, for a scorer (tasks/reward_runner.py)."""
        from grpo_fleet.tasks.reward_runner import RewardSet

        return RewardSet(names=tuple(self.reward_names), weights=tuple(self.reward_weights), module=self.reward_module,
                         timeout_seconds=self.reward_timeout_seconds, bound=self.reward_bound)

    def score(self, completion_text: str, example: Example) -> float:
        """This task's reward for one completion, scored inline; a failing reward raises ValueError."""
        from grpo_fleet.tasks.reward_runner import InlineScorer

        (result,) = InlineScorer(self.reward_set()).score([self.job(example, [completion_text])])
        if result.rewards is None:
            assert result.failure is not None
            raise ValueError(f"reward {result.failure.reward} failed: {result.failure.error}: {result.failure.detail}")
        return result.rewards[0]


def build_task(cfg: "TaskConfig") -> Task:
    """The Task a TaskConfig describes; reward names are checked before any data is loaded."""
    from grpo_fleet.tasks.reward_module import canonical_spec

    module = canonical_spec(cfg.reward_module) if cfg.reward_module else None
    weights = validate_rewards(cfg.rewards, cfg.reward_weights, module)
    if cfg.name == "reverse":
        train, eval_examples = _reverse_splits(cfg)
    elif cfg.name == "jsonl":
        train, eval_examples = _jsonl_splits(cfg)
    elif cfg.name == "dataset":
        train, eval_examples = _dataset_splits(cfg)
    elif cfg.name == "reasoning_gym":
        train, eval_examples = _reasoning_gym.make_splits(cfg.dataset or "", cfg.generator_options, cfg.num_train,
                                                          cfg.num_eval, cfg.seed)
    else:
        raise ValueError(f"unknown task {cfg.name!r}; known tasks: dataset, jsonl, reasoning_gym, reverse")
    return Task(
        name=cfg.name,
        train=train,
        eval=eval_examples,
        reward_names=list(cfg.rewards),
        reward_weights=weights,
        reward_module=module,
        reward_timeout_seconds=cfg.reward_timeout_seconds,
        reward_bound=cfg.reward_bound,
        env=_env_setup(cfg),
    )


def _env_setup(cfg: "TaskConfig") -> Optional["EnvSetup"]:
    """task.env, its module made canonical and its class checked to load (a bad one fails the run at start)."""
    if not cfg.env:
        return None
    from grpo_fleet.tasks.env_module import EnvSetup, canonical_env, load_env_class

    module, class_name = canonical_env(cfg.env)
    load_env_class(module, class_name)
    return EnvSetup(module=module, class_name=class_name, config=dict(cfg.env_config), max_turns=cfg.max_turns,
                    max_episode_tokens=cfg.max_episode_tokens, timeout_seconds=cfg.env_timeout_seconds)


def _reverse_splits(cfg: "TaskConfig") -> tuple[list[Example], list[Example]]:
    return make_reverse_splits(cfg.num_train, cfg.num_eval, cfg.digits, cfg.seed)


def _jsonl_splits(cfg: "TaskConfig") -> tuple[list[Example], list[Example]]:
    """Train from train_path; eval from eval_path (first num_eval) or rows of train held out by task.seed."""
    from grpo_fleet.tasks.jsonl import load_jsonl

    if not cfg.train_path:
        raise ValueError("task 'jsonl' needs train_path")
    train_file = resolve_task_path(cfg.train_path)
    train = load_jsonl(train_file)
    if not train:
        raise ValueError(f"{train_file}: no examples")
    if cfg.eval_path is not None:
        return train, load_jsonl(resolve_task_path(cfg.eval_path))[: cfg.num_eval]
    return _hold_out(train, cfg.num_eval, cfg.seed, str(train_file), "give eval_path")


def _dataset_splits(cfg: "TaskConfig") -> tuple[list[Example], list[Example]]:
    """Train from task.split of task.dataset; eval from task.eval_split (first num_eval) or rows held out by task.seed."""
    from grpo_fleet.tasks.columns import examples_from_rows, prompt_column_of, require_column
    from grpo_fleet.tasks.hf_datasets import load_split

    if not cfg.dataset:
        raise ValueError("task 'dataset' needs task.dataset (a hub id or a local path)")

    dataset = cfg.dataset

    def examples(split: str) -> list[Example]:
        rows = load_split(dataset, split, config=cfg.dataset_config)
        source = f"{dataset} split {split!r}"
        prompt_column = prompt_column_of(rows.column_names, cfg.prompt_column, source)
        require_column(rows.column_names, cfg.answer_column, "task.answer_column", source)
        return examples_from_rows(rows, prompt_column=prompt_column, answer_column=cfg.answer_column, source=source)

    train = examples(cfg.split)
    if cfg.eval_split is not None:
        return train, examples(cfg.eval_split)[: cfg.num_eval]
    return _hold_out(train, cfg.num_eval, cfg.seed, f"{cfg.dataset} split {cfg.split!r}", "give task.eval_split")


def _hold_out(train: list[Example], num_eval: int, seed: int, source: str,
              remedy: str) -> tuple[list[Example], list[Example]]:
    """Split num_eval examples, drawn by a permutation seeded with `seed`, off for eval; both keep file order.

    Drawn, not the file's tail: a sorted or chronological file would otherwise
    be evaluated on its largest or latest rows only.
    """
    # Hold out at most half so a small file still leaves most of it for training.
    held_out = min(num_eval, len(train) // 2)
    if held_out == 0:
        raise ValueError(f"{source}: only {len(train)} example(s), too few to hold out an eval split; {remedy}")
    permutation = list(range(len(train)))
    random.Random(seed).shuffle(permutation)
    chosen = set(permutation[:held_out])
    kept = [example for index, example in enumerate(train) if index not in chosen]
    return kept, [train[index] for index in sorted(chosen)]
