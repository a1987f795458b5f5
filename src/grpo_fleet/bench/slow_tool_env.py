"""The bench's stand-in for a tool that takes time (bench/episodes.py): every step waits, then asks for another turn.

Imports nothing from grpo_fleet, as a user's environment would; it runs in the
actor's environment process. `delay_seconds` is what each step waits (a search,
an interpreter, a judge), and `async_step` makes the wait a coroutine's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class SlowTool:
    deterministic = True

    def __init__(self, env_config: dict[str, Any], extras: dict[str, Any]) -> None:
        self.delay = float(env_config.get("delay_seconds", 0.0))
        self.turn = 0

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        return self._result()

    def _result(self) -> dict[str, Any]:
        self.turn += 1
        return {"observations": [{"role": "user", "content": f"<tool_response>\nresult {self.turn}\n</tool_response>"}],
                "reward": 0.0, "done": False, "metadata": {}}


class AsyncSlowTool(SlowTool):
    async def step(self, action: str) -> dict[str, Any]:  # type: ignore[override]  # the async form of the interface
        if self.delay:
            await asyncio.sleep(self.delay)
        return self._result()
