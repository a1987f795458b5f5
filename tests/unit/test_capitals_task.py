"""The real-model demo's task (grpo_fleet/demos/smollm2-135m-instruct): its data, and its user reward file."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.config import load_run_config
from grpo_fleet.tasks import Example, Task, build_task
from grpo_fleet.tasks import reward_module as reward_module_mod
from grpo_fleet.tasks import rewards as registry

DEMO_DIR = Path(__file__).resolve().parents[2] / "src" / "grpo_fleet" / "demos" / "smollm2-135m-instruct"
CONFIG = DEMO_DIR / "demo.toml"


@pytest.fixture
def task(monkeypatch: pytest.MonkeyPatch) -> Task:
    """The configured task, built as the learner builds it (paths from the demo's folder, a private reward registry)."""
    monkeypatch.chdir(DEMO_DIR)
    monkeypatch.setattr(registry, "REWARDS", dict(registry.REWARDS))
    monkeypatch.setattr(reward_module_mod, "REWARDS", registry.REWARDS)
    return build_task(load_run_config(CONFIG).task)


def test_held_out_countries_are_not_trained_on(task: Task):
    train = {ex.prompt for ex in task.train}
    held_out = {ex.prompt for ex in task.eval}
    assert len(held_out) == 32 and len(train) == 24
    assert not train & held_out


@pytest.mark.parametrize("completion, want", [
    ("The capital of Kenya is Nairobi.", 1.0),             # the right city in one finished sentence
    ("Nairobi.", 1.0),
    ("nairobi!", 1.0),                                     # case does not matter
    ("Nairobi", 0.5),                                      # right, but no finished sentence
    ("The capital of Kenya is Nairobi, a city of", 0.5),   # cut off at the token budget
    ("Nairobi. It is in Kenya.", 0.5),                     # runs on after its sentence
    ("The capital of Kenya is Mombasa.", 0.0),             # a finished sentence, wrong city
    ("Nairobian.", 0.0),                                   # the name as a whole word only
    ("", 0.0),
])
def test_reward_is_for_the_right_city_in_one_finished_sentence(task: Task, completion: str, want: float):
    example = Example(prompt="What is the capital of Kenya?", answer="Nairobi")
    assert task.score(completion, example) == pytest.approx(want)


def test_accents_in_the_reference_are_optional_in_the_reply(task: Task):
    example = Example(prompt="What is the capital of Brazil?", answer="Brasília")
    assert task.score("The capital is Brasilia.", example) == pytest.approx(1.0)
    assert task.score("Brasília", example) == pytest.approx(0.5)
