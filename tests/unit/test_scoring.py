"""The reward policy (tasks/scoring.py), user reward modules and the inline scorer: no processes here."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from grpo_fleet.tasks import Example, prompt_text, reward_kwargs
from grpo_fleet.tasks import rewards as reward_registry
from grpo_fleet.tasks.reward_module import (
    RewardModuleError,
    canonical_spec,
    is_module_name,
    load_module,
    load_rewards,
    module_digest,
)
from grpo_fleet.tasks.reward_runner import InlineScorer, RewardSet, RewardsRefused
from grpo_fleet.tasks.rewards import UnknownRewardError
from grpo_fleet.tasks.scoring import RewardError, RewardFailure, ScoringJob, checked_value, combine, group_score

USER_REWARDS = '''
import math
from grpo_fleet.tasks import register_reward

@register_reward
def says_yes(completion, prompt, *, answer, **columns):
    return 1.0 if "yes" in completion else 0.0

@register_reward("level_bonus")
def by_level(completion, prompt, *, answer, level=0, **columns):
    return 0.1 * level

def listed_by_name(completion, prompt, **columns):
    return None if completion == "skip" else 0.5

def explodes(completion, prompt, **columns):
    raise ZeroDivisionError("bad luck")

def not_finite(completion, prompt, **columns):
    return math.nan

def wordy(completion, prompt, **columns):
    return "high"

async def awaited(completion, prompt, **columns):
    return 0.25

def slow(completion, prompt, **columns):
    import time
    time.sleep(0.3)
    return 1.0
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(reward_registry, "REWARDS", dict(reward_registry.REWARDS))
    # load_rewards looks names up through the module attribute, so patch where it is read too.
    import grpo_fleet.tasks.reward_module as reward_module

    monkeypatch.setattr(reward_module, "REWARDS", reward_registry.REWARDS)
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    yield str(path)


def scorer(names: list[str], module: str, *, weights: list[float] | None = None, timeout: float = 10.0,
           bound: float = 1e4) -> InlineScorer:
    return InlineScorer(RewardSet(names=tuple(names), weights=tuple(weights or [1.0] * len(names)), module=module,
                                  timeout_seconds=timeout, bound=bound))


def job(*completions: str, **columns: Any) -> ScoringJob:
    return ScoringJob(prompt="Is it?", columns={"answer": "yes", **columns}, completions=list(completions))


# ---------------------------------------------------------------- the policy


@pytest.mark.parametrize("value, expected", [(None, None), (1, 1.0), (True, 1.0), (0.5, 0.5), (-3, -3.0)])
def test_checked_value_takes_numbers_and_none(value: Any, expected: Any) -> None:
    assert checked_value("r", value, 10.0) == expected


@pytest.mark.parametrize("value, error", [
    ("1.0", RewardError.NOT_A_NUMBER), ([1.0], RewardError.NOT_A_NUMBER), (math.nan, RewardError.NON_FINITE),
    (-math.inf, RewardError.NON_FINITE), (11.0, RewardError.OUT_OF_BOUNDS), (1e39, RewardError.OUT_OF_BOUNDS),
])
def test_checked_value_names_every_bad_value(value: Any, error: RewardError) -> None:
    failure = checked_value("r", value, 10.0)
    assert isinstance(failure, RewardFailure) and failure.error is error and failure.reward == "r"


def test_none_adds_nothing_and_all_none_is_no_reward() -> None:
    assert combine([None, 0.5], [3.0, 2.0]) == 1.0
    assert combine([None, None], [1.0, 1.0]) is None


def test_group_score_fails_the_whole_group_never_a_partial_score() -> None:
    failure = RewardFailure("r", RewardError.EXCEPTION, "boom")
    assert group_score([[1.0], [0.0]], [1.0], 10.0).rewards == [1.0, 0.0]
    assert group_score([[1.0], [failure]], [1.0], 10.0).failure == failure
    no_score = group_score([[1.0], [None]], [1.0], 10.0)
    assert no_score.rewards is None and no_score.failure is not None and no_score.failure.error is RewardError.NO_SCORE
    too_big = group_score([[6.0, 6.0]], [1.0, 1.0], 10.0)
    assert too_big.failure is not None and too_big.failure.error is RewardError.OUT_OF_BOUNDS, "the weighted sum too"


# ---------------------------------------------------------------- the user's module


def test_a_user_file_registers_by_decorator_and_by_name(user_module: str) -> None:
    result = scorer(["says_yes", "level_bonus", "listed_by_name", "exact_match"], user_module).score(
        [job("yes", "no", "skip", level=3)])
    # says_yes + 0.1 * level + listed_by_name (None for "skip") + exact_match against answer "yes"
    assert result[0].rewards == pytest.approx([1.0 + 0.3 + 0.5 + 1.0, 0.3 + 0.5, 0.3])


def test_every_bad_reward_is_a_named_failure(user_module: str) -> None:
    for name, error in [("explodes", RewardError.EXCEPTION), ("not_finite", RewardError.NON_FINITE),
                        ("wordy", RewardError.NOT_A_NUMBER)]:
        (result,) = scorer([name], user_module).score([job("yes")])
        assert result.rewards is None and result.failure == RewardFailure(name, error, result.failure.detail)
    (result,) = scorer(["explodes"], user_module).score([job("yes")])
    assert result.failure is not None and "ZeroDivisionError: bad luck" in result.failure.detail


def test_an_async_reward_is_awaited(user_module: str) -> None:
    assert scorer(["awaited"], user_module).score([job("a")])[0].rewards == [0.25]


def test_inline_calls_past_the_timeout_fail_too(user_module: str) -> None:
    started = time.perf_counter()
    (result,) = scorer(["slow"], user_module, timeout=0.1).score([job("a", "b")])
    assert result.failure is not None and result.failure.error is RewardError.TIMEOUT
    assert time.perf_counter() - started < 1.0, "the group stops at its first failure"


def test_unknown_names_and_broken_modules_are_refused_clearly(user_module: str, tmp_path: Path) -> None:
    with pytest.raises(RewardsRefused, match="unknown reward 'nope'.*nor is it a function"):
        scorer(["nope"], user_module)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_package_anywhere\n")
    with pytest.raises(RewardsRefused, match="importing reward module .*ModuleNotFoundError"):
        scorer(["x"], str(broken))
    with pytest.raises(RewardModuleError, match="no such file"):
        module_digest(str(tmp_path / "missing.py"))
    with pytest.raises(UnknownRewardError):
        load_rewards(["nope"], None)


def test_the_digest_follows_the_bytes(user_module: str) -> None:
    before = module_digest(user_module)
    assert module_digest(user_module) == before
    Path(user_module).write_text(USER_REWARDS + "\n# one more line\n")
    assert module_digest(user_module) != before


def test_a_module_name_and_a_package_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from my_pkg.scores import one\n")
    (package / "scores.py").write_text("def one(completion, prompt, **columns):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert is_module_name("my_pkg") and not is_module_name("my_rewards.py") and canonical_spec("my_pkg") == "my_pkg"
    before = module_digest("my_pkg")
    (package / "scores.py").write_text("def one(completion, prompt, **columns):\n    return 0.0\n")
    assert module_digest("my_pkg") != before, "a package's digest covers every file in it"
    assert load_module("my_pkg").one("c", "p") == 0.0


def test_rewards_get_every_column_and_the_prompt_text() -> None:
    example = Example(prompt=({"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}),
                      answer="4", columns={"answer": "2+2=4 #### 4", "level": 1, "completion": "ref"})
    assert prompt_text(example.prompt) == "2+2?" and prompt_text("plain") == "plain"
    assert reward_kwargs(example) == {"answer": "4", "level": 1, "dataset_completion": "ref"}
