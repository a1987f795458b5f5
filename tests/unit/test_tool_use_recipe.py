"""The tool-use recipe (demos/smollm2-135m-instruct/tool-use.toml): its config, worked examples and held-out split."""

from __future__ import annotations

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.calculator import evaluate, shown
from grpo_fleet.envs.tools import parse_tool_call
from grpo_fleet.launch.demo import DemoOptions, demo_settings
from grpo_fleet.tasks import build_task


def test_the_recipe_is_a_calculator_episode_whose_answers_the_tool_computes() -> None:
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct", config="tool-use")))
    assert cfg.task.env == "grpo_fleet.envs.calculator:Calculator" and cfg.task.max_turns >= 2
    task = build_task(cfg.task)
    assert task.env is not None and task.env.class_name == "Calculator"
    for example in [*task.train, *task.eval]:
        *shots, question = example.prompt
        assert question["role"] == "user"
        calls = [parse_tool_call(m["content"]) for m in shots if m["role"] == "assistant" and "<tool_call>" in m["content"]]
        assert len(calls) == 3 and all(c is not None and c.name == "calculate" for c in calls)  # three worked examples
        expression = question["content"].removeprefix("What is ").removesuffix("?")
        assert shown(evaluate(expression)) == example.answer  # the tool computes what the reward wants


def test_the_held_out_questions_are_others_with_larger_numbers() -> None:
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct", config="tool-use")))
    task = build_task(cfg.task)
    train = {example.prompt[-1]["content"] for example in task.train}
    held_out = {example.prompt[-1]["content"] for example in task.eval}
    assert train.isdisjoint(held_out) and len(held_out) == 16
    assert all(len(q.split()[2]) == 4 for q in held_out) and all(len(q.split()[2]) == 3 for q in train)
