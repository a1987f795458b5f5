"""The shipped tool-use environment (envs/calculator.py): arithmetic only, and its rewards."""

from __future__ import annotations

import time

import pytest

from grpo_fleet.envs.calculator import CalculationError, Calculator, evaluate, numbers_in

CALL = '<tool_call>{{"name": "calculate", "arguments": {{"expression": "{}"}}}}</tool_call>'


def quiz(answer: str, **config: float) -> Calculator:
    env = Calculator(dict(config), {"reward_spec": {"method": "rule", "ground_truth": answer}})
    env.init([{"role": "user", "content": "What is 347 * 29?"}])
    return env


@pytest.mark.parametrize(("expression", "value"), [("347 * 29", 10063), ("(2 + 3) * -4", -20), ("7 / 2", 3.5),
                                                  ("2 ** 10", 1024), ("17 % 5", 2)])
def test_arithmetic_is_evaluated(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "open('/etc/passwd')", "x + 1",
                                        "9 ** 9 ** 9", "10 ** 100", "1 / 0", "[1] * 3", "(" * 500 + "1" + ")" * 500,
                                        "1 + " * 100 + "1", "lambda: 1"])
def test_anything_but_small_arithmetic_is_refused_without_running_it(expression: str) -> None:
    with pytest.raises(CalculationError):
        evaluate(expression)


def test_the_right_answer_after_a_call_is_worth_one_in_all_and_the_call_its_share_at_once() -> None:
    env = quiz("10063", tool_reward=0.2)
    called = env.step(CALL.format("347 * 29"))
    assert called["reward"] == pytest.approx(0.2) and "10063" in called["observations"][0]["content"]
    again = env.step(CALL.format("347 * 29"))
    assert again["reward"] == 0.0 and not again["done"]  # the share is paid once
    final = env.step("347 * 29 = 10,063.")
    assert final["done"] and called["reward"] + final["reward"] == pytest.approx(1.0)


def test_a_wrong_answer_or_a_call_for_another_value_earns_nothing() -> None:
    env = quiz("10063")
    assert env.step(CALL.format("347 + 29"))["reward"] == 0.0
    assert env.step("It is 10000.")["reward"] == 0.0
    assert quiz("10063").step("10063")["reward"] == 1.0  # right without the tool: the whole reward


def test_a_bad_expression_is_the_models_to_read_and_the_delay_is_slept() -> None:
    env = quiz("4", delay_seconds=0.05)
    started = time.perf_counter()
    observation = env.step(CALL.format("two plus two"))["observations"][0]["content"]
    assert time.perf_counter() - started >= 0.05  # a tool that takes time (bench and recipe: tool delay)
    assert "error" in observation and "CalculationError" not in observation
    assert numbers_in("about 1,234.5 or -7") == ["1234.5", "-7"]
