"""The real-model demo's task (configs/smollm2-135m-capitals.toml): its data, and its user reward file."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.config import load_run_config
from grpo_fleet.tasks import Example, Task, build_task
from grpo_fleet.tasks import reward_module as reward_module_mod
from grpo_fleet.tasks import rewards as registry

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "smollm2-135m-capitals.toml"


@pytest.fixture
def task(monkeypatch: pytest.MonkeyPatch) -> Task:
    """The configured task, built as the learner builds it (from the checkout, with a private reward registry)."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(registry, "REWARDS", dict(registry.REWARDS))
    monkeypatch.setattr(reward_module_mod, "REWARDS", registry.REWARDS)
    return build_task(load_run_config(CONFIG).task)


def test_held_out_countries_are_not_trained_on(task: Task):
    train = {ex.prompt for ex in task.train}
    held_out = {ex.prompt for ex in task.eval}
    assert len(held_out) == 32 and len(train) == 24
    assert not train & held_out


@pytest.mark.parametrize("completion, want", [
    ("Nairobi", 1.0),
    ("Nairobi.", 1.0),
    ("The capital of Kenya is Nairobi.", 0.3 + 0.7 / 6),  # what the base model says
    ("nairobi!", 1.0),                                     # case and punctuation do not matter
    ("Mombasa", 0.0),                                      # short but wrong earns nothing
    ("Nairobian", 0.0),                                    # the name as a whole word only
    ("", 0.0),
])
def test_reward_is_for_the_right_city_alone(task: Task, completion: str, want: float):
    example = Example(prompt="What is the capital of Kenya?", answer="Nairobi")
    assert task.score(completion, example) == pytest.approx(want)


def test_accents_in_the_reference_are_optional_in_the_reply(task: Task):
    example = Example(prompt="What is the capital of Brazil?", answer="Brasília")
    assert task.score("Brasilia", example) == pytest.approx(1.0)
    assert task.score("The capital is Brasília.", example) == pytest.approx(0.3 + 0.7 / 4)
