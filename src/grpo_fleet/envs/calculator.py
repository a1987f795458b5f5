"""A shipped tool-use environment: arithmetic a small model cannot do in its head, with a calculator it may call.

    task.env = "grpo_fleet.envs.calculator:Calculator"

The prompt asks for a product or sum of numbers of several digits ("What is
347 * 29?"), which SmolLM2-135M gets right about never on its own. The model may
call the calculator, as the system prompt shows:

    <tool_call>{"name": "calculate", "arguments": {"expression": "347 * 29"}}</tool_call>

and read the result in the next observation, then answer. A final answer (a turn
with no tool call) that contains the right number ends the episode with reward 1
in all. The first well-formed call that computes the question's exact value
earns `tool_reward` (0.2) of it at once, so that the tool's use is worth
learning before the model has learnt to copy its result. Every call waits `delay_seconds` (0 by
default), standing in for a tool that takes time: a search, a sandboxed
interpreter, a judge.

The calculator evaluates arithmetic only (numbers, + - * / // % and parentheses,
** with a small exponent), parsed by `ast`, never `eval`: nothing the model
writes runs as code, and a result past `MAX_DIGITS` digits is refused.
"""

from __future__ import annotations

import ast
import operator
import re
import time
from typing import Any, Callable, Optional

from grpo_fleet.envs.tools import ToolEnv

MAX_DIGITS = 60  # of any operand or result: huge powers are refused, not computed
MAX_EXPONENT = 64
MAX_NODES = 64  # of an expression's syntax tree

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """An expression the calculator will not evaluate; its message is what the model is told."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers and operators only)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        raise CalculationError(f"cannot read {expression[:80]!r} as arithmetic") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculationError("the expression is too long")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculationError(f"exponents above {MAX_EXPONENT} are not computed")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculationError(str(exc)) from None
    raise CalculationError("only numbers, + - * / // % ** and parentheses are allowed")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculationError("the result is not a real number")
    if abs(value) >= 10 ** MAX_DIGITS:
        raise CalculationError(f"numbers of more than {MAX_DIGITS} digits are not computed")
    return value


def shown(value: int | float) -> str:
    """A result as the model reads it: whole numbers without a decimal point."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def numbers_in(text: str) -> list[str]:
    """The numbers a reply writes, thousands separators dropped ("10,063" reads as 10063)."""
    return [n.replace(",", "") for n in re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)]


class Calculator(ToolEnv):
    """One arithmetic question; a `calculate` tool; reward 1 for the right number in the final answer."""

    tools = ("calculate",)
    # The same turns always get the same results and reward (the delay changes no answer): the learner may replay
    # its episodes to check them (security.verify_rewards).
    deterministic = True

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None) -> None:
        super().__init__(env_config, extras)
        self.answer_text = str(self.extras.get("reward_spec", {}).get("ground_truth", ""))
        self.delay_seconds = float(self.env_config.get("delay_seconds", 0.0))
        self.tool_reward = float(self.env_config.get("tool_reward", 0.2))
        self.rewarded_call = False

    def calculate(self, expression: str) -> str:
        if self.delay_seconds > 0:
            time.sleep(self.delay_seconds)
        value = shown(evaluate(str(expression)))
        if value == self.answer_text and not self.rewarded_call:
            self.rewarded_call = True
        return value

    def step(self, action: str) -> dict[str, Any]:
        earned = self.rewarded_call
        result = super().step(action)
        if self.rewarded_call and not earned:  # this turn's call computed the question's value: its share now
            result["reward"] += self.tool_reward
        return result

    def answer(self, text: str) -> float:
        if self.answer_text not in numbers_in(text):
            return 0.0
        return 1.0 - (self.tool_reward if self.rewarded_call else 0.0)

    def run_tool(self, call: Any) -> str:
        result = super().run_tool(call)
        return result.replace("failed: CalculationError: ", "")  # the model needs the reason, not our class name
