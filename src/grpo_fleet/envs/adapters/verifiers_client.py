"""The model a verifiers rollout talks to: a `vf.Client` with no model behind it, whose answers are our samples.

verifiers drives its own loop (`MultiTurnEnv.rollout`): it asks the client for the
model's reply, appends it, calls `env_response`, checks its stop conditions. Here
each request goes out on a queue as a `Turn`, and the rollout waits until grpo-fleet
answers with the text our policy sampled, token in, token out, on the actor. No
verifiers client, server or tokenizer is ever used: the reply is only text to
verifiers, and the ids, logprobs and masks that train stay ours.

A reply that calls tools, in the Hermes / Qwen convention grpo-fleet's own tools use
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), becomes the message's
`tool_calls`, as a vLLM server's tool parser would make them; a call that cannot be
read leaves the reply plain text (so a ToolEnv ends there, as it would with vLLM).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

try:
    import verifiers as vf
except ImportError as exc:  # one line at start-up, naming the extra
    raise ImportError(f"task.env's verifiers adapter needs the verifiers package: pip install "
                      f"'grpo-fleet[verifiers]' ({exc})") from None
if not hasattr(vf, "MultiTurnEnv"):
    raise ImportError(f"verifiers {getattr(vf, '__version__', '?')} has no MultiTurnEnv (0.4.0 replaced environments "
                      "with harness programs that call a model server of their own): pip install "
                      "'grpo-fleet[verifiers]', which pins 0.3.1")

from verifiers.clients import Client  # noqa: E402  (only once the check above passed)
from verifiers.types import Response, ResponseMessage, ToolCall  # noqa: E402

from grpo_fleet.envs.protocol import EnvError
from grpo_fleet.envs.tools import CLOSE_TAG, OPEN_TAG


@dataclass(frozen=True)
class Turn:
    """The rollout asks for the model's next reply: the messages it would send, and the future our text goes into."""

    messages: list[dict[str, Any]]
    reply: asyncio.Future[str]


class TurnClient(Client):
    """Puts each request on `turns` and answers with the text grpo-fleet sets on the turn's future."""

    def __init__(self, turns: asyncio.Queue[Any]) -> None:
        super().__init__(None)
        self.turns = turns
        self.replies = 0

    async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                           **kwargs: Any) -> Response:
        reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self.turns.put(Turn(plain_messages(prompt), reply))
        text = await reply
        self.replies += 1
        return as_response(text, model, self.replies, parse_calls=bool(tools))

    # What a client with a model behind it converts; nothing here does.
    def setup_client(self, config: Any) -> None:
        return None

    async def to_native_tool(self, tool: Any) -> Any:
        return tool

    async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
        return messages, {}

    async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                  **kwargs: Any) -> Any:
        raise NotImplementedError("grpo-fleet samples every reply itself (TurnClient.get_response)")

    async def raise_from_native_response(self, response: Any) -> None:
        return None

    async def from_native_response(self, response: Any) -> Any:
        return response

    async def close(self) -> None:
        return None


def as_response(text: str, model: str, number: int, parse_calls: bool) -> Response:
    """Our reply as verifiers' Response: its text, and its tool calls when the environment offers tools."""
    calls = tool_calls(text, number) if parse_calls else []
    content = text[: text.find(OPEN_TAG)].strip() if calls else text
    message = ResponseMessage(role="assistant", content=content, tool_calls=calls or None,
                              finish_reason="tool_calls" if calls else "stop", is_truncated=False)
    # A fixed id and time: the same replies give the same state, so a deterministic environment replays exactly.
    return Response(id=f"grpo-fleet-{number}", created=0, model=model, message=message)


def tool_calls(text: str, number: int) -> list[ToolCall]:
    """Every `<tool_call>` in the reply, or none if any of them cannot be read (as a server's parser gives up)."""
    calls: list[ToolCall] = []
    start = text.find(OPEN_TAG)
    while start >= 0:
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end < 0:
            return []
        try:
            call = json.loads(text[start + len(OPEN_TAG):end])
        except (ValueError, RecursionError):
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(
                call.get("arguments", {}), dict):
            return []
        calls.append(ToolCall(id=f"call_{number}_{len(calls)}", name=call["name"],
                              arguments=json.dumps(call.get("arguments", {}))))
        start = text.find(OPEN_TAG, end + len(CLOSE_TAG))
    return calls


def plain_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """verifiers' messages (pydantic models or dicts) as {"role", "content"} dicts; a tool result keeps its call id."""
    return [_plain(message) for message in messages]


def _plain(message: Any) -> dict[str, Any]:
    fields = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
    plain = {"role": str(fields.get("role")), "content": _text(fields.get("content"))}
    if isinstance(fields.get("tool_call_id"), str):
        plain["tool_call_id"] = fields["tool_call_id"]
    return plain


def _text(content: Any) -> str:
    """A message's content as text: text parts joined; an image or audio part cannot be tokenized here."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[Optional[str]] = []
    for part in content:
        part = part if isinstance(part, dict) else part.model_dump()
        if part.get("type") != "text":
            raise EnvError(f"the verifiers environment sent a {part.get('type')!r} content part; only text is supported")
        texts.append(part.get("text"))
    return "".join(text or "" for text in texts)
