"""The long-answer recipe (demos/smollm2-135m-instruct/long-answers.toml): its config, data and partial-credit rewards."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import DemoOptions, demo_settings, packaged_demo

FOLDER = packaged_demo("smollm2-135m-instruct").parent


@functools.cache  # the module registers its rewards: load it once
def _rewards() -> ModuleType:
    spec = importlib.util.spec_from_file_location("countries_rewards_under_test", FOLDER / "countries_rewards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_asks_for_long_answers_with_held_out_prompts() -> None:
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct", config="long-answers")))
    assert cfg.generation.max_tokens >= 256 and cfg.task.reward_module == str(FOLDER / "countries_rewards.py")
    train = [json.loads(line) for line in Path(cfg.task.train_path).read_text().splitlines()]
    held_out = [json.loads(line) for line in Path(str(cfg.task.eval_path)).read_text().splitlines()]
    assert {row["prompt"] for row in train}.isdisjoint(row["prompt"] for row in held_out)
    assert {int(row["answer"]) for row in train}.isdisjoint(int(row["answer"]) for row in held_out)


def test_every_real_country_among_the_first_n_lines_earns_credit_once() -> None:
    rewards = _rewards()
    reply = "1. France\n2. Germany\n3. germany\n- The Netherlands\nCôte d'Ivoire\nAtlantis"
    assert rewards.countries_listed(reply, "", answer="8") == pytest.approx(4 / 8)  # a repeat and a myth earn nothing
    assert rewards.countries_listed(reply, "", answer="4") == pytest.approx(3 / 4)  # the 5th line is past N = 4
    assert rewards.countries_listed("USA\nUnited States of America\nAmerica", "", answer="3") == pytest.approx(1 / 3)
    assert rewards.countries_listed("Peru\nChile\nCuba", "", answer="3") == 1.0
    assert rewards.countries_listed("Peru\nChile\nCuba\nFiji", "", answer="2") == 1.0  # running on earns nothing
    assert rewards.countries_listed("Here are some countries you may like.", "", answer="5") == 0.0
    assert rewards.countries_listed("", "", answer="3") == 0.0
