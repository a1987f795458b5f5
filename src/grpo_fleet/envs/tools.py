"""The ready-made tool-calling convention: a `<tool_call>` in the model's turn runs a method of the environment.

The model calls a tool as Qwen and Hermes models do, anywhere in its turn:

    <tool_call>{"name": "lookup", "arguments": {"country": "Kenya"}}</tool_call>

The environment's method of that name (listed in `tools`) runs with those
arguments, and what it returns, as text, is the next observation:

    {"role": "user", "content": "<tool_response>\\nNairobi\\n</tool_response>"}

A turn with no tool call is the final answer: `answer(text)` scores it and the
episode ends. A malformed call (not JSON, no name, a tool that is not listed,
arguments that are not an object or that the method does not take, a tool that
raises) gets an observation saying what was wrong, "<tool_response>\\nerror:
...\\n</tool_response>", with reward 0: the model sees it and may try again, and
nothing crashes. Each call is one turn, so task.max_turns bounds the calls.

`ToolEnv` is optional: it follows skyrl-gym's interface (envs/protocol.py), so an
environment can subclass it, or copy the convention and import nothing.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Optional

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
RESULT_CHARS = 2000


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A tool call the model wrote but that cannot run; its message is what the model is told."""


def parse_tool_call(text: str) -> Optional[ToolCall]:
    """The first tool call in a turn; None when the turn has none; ToolCallError when it is malformed.

    Found with two `str.find`s, linear in the turn: a lazy regex tried every open
    tag against the rest of the turn, about 1 s on 4,096 unclosed tags.
    """
    start = text.find(OPEN_TAG)
    if start < 0:
        return None
    end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
    if end < 0:
        raise ToolCallError("the tool call has no closing </tool_call>")
    call = _json(text[start + len(OPEN_TAG):end])
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('the tool call needs a "name" string: {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be an object')
    return ToolCall(call["name"], arguments)


def _json(body: str) -> Any:
    """The call's JSON; whatever the model wrote, a ToolCallError when it cannot be read."""
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool call is not JSON ({exc.msg})") from None
    except RecursionError:  # arrays or objects nested past the interpreter's recursion limit
        raise ToolCallError("the tool call's JSON is nested too deeply") from None
    except ValueError as exc:  # an integer past the interpreter's 4,300-digit limit on parsing
        raise ToolCallError(f"the tool call's JSON holds a value that cannot be read ({str(exc)[:80]})") from None


def tool_response(content: str) -> dict[str, Any]:
    """The observation message that carries a tool's result (or the error) back to the model."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


class ToolEnv:
    """A skyrl-gym style environment whose steps run tool calls; subclass it, list `tools`, define `answer`."""

    tools: tuple[str, ...] = ()

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None) -> None:
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})
        self.turns = 0

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    def answer(self, text: str) -> float:
        """The reward of a final answer (a turn with no tool call). Override it."""
        return 0.0

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        try:
            call = parse_tool_call(action)
        except ToolCallError as exc:
            return self._observe(f"error: {exc}")
        if call is None:
            return {"observations": [], "reward": float(self.answer(action)), "done": True, "metadata": {}}
        return self._observe(self.run_tool(call))

    def run_tool(self, call: ToolCall) -> str:
        """The tool's result as text, or what was wrong with the call."""
        if call.name not in self.tools or not callable(getattr(self, call.name, None)):
            return f"error: no tool {call.name!r}; the tools are {', '.join(self.tools) or 'none'}"
        method = getattr(self, call.name)
        try:
            inspect.signature(method).bind(**call.arguments)
        except TypeError as exc:
            return f"error: {call.name} does not take those arguments ({exc})"
        try:
            return str(method(**call.arguments))[:RESULT_CHARS]
        except Exception as exc:  # the tool's own failure is the model's to see
            return f"error: {call.name} failed: {type(exc).__name__}: {exc}"[:RESULT_CHARS]

    def _observe(self, content: str) -> dict[str, Any]:
        return {"observations": [tool_response(content)], "reward": 0.0, "done": False, "metadata": {}}
