"""One verifiers rollout, run by verifiers' own loop and paused at each model call until grpo-fleet answers.

`MultiTurnEnv.rollout` runs as a task on the process's background loop, with a
`TurnClient` as its model. Each time it asks for a reply, the request comes out of
`next_event` as a `Turn`; `answer` gives it our text and waits for the next
request, or for the rollout's end. At the end the environment's rubric scores the
final state (`rubric.score_rollout`, then `rubric.cleanup`), exactly as verifiers
does for one rollout, and the state comes out as `Finished`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Union

from grpo_fleet.envs.adapters.verifiers_client import Turn, TurnClient
from grpo_fleet.envs.protocol import EnvError

MODEL_NAME = "grpo-fleet"  # what state["model"] says: the policy is ours, sampled by the actor


@dataclass(frozen=True)
class Finished:
    """The rollout ended and was scored: verifiers' final state (reward, metrics, stop_condition, ...)."""

    state: Any


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Union[Turn, Finished]


class Rollout:
    """Drives one rollout of `env` on `input` (verifiers' RolloutInput: prompt, example_id, answer, info)."""

    def __init__(self, env: Any, rollout_input: dict[str, Any]) -> None:
        self.env, self.input = env, rollout_input
        self.events: Optional[asyncio.Queue[Union[Turn, Finished, Failed]]] = None
        self.task: Optional[asyncio.Task[None]] = None
        self.pending: Optional[Turn] = None

    async def start(self) -> Event:
        """Start the rollout; its first request (the prompt), or its end if it asks for nothing."""
        self.events = asyncio.Queue()
        self.task = asyncio.create_task(self._run(TurnClient(self.events)))
        return await self._next()

    async def answer(self, text: str) -> Event:
        """Give the pending request our reply; the next request, or the scored end."""
        if self.pending is None:
            raise EnvError("step called with no model turn pending (init first, and not after done)")
        pending, self.pending = self.pending, None
        pending.reply.set_result(text)
        return await self._next()

    async def stop(self) -> None:
        """Cancel a rollout that is still waiting for a reply (an episode our runner ended first)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def _next(self) -> Event:
        assert self.events is not None
        event = await self.events.get()
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Turn):
            self.pending = event
        return event

    async def _run(self, client: TurnClient) -> None:
        assert self.events is not None
        try:
            state = await self.env.rollout(self.input, client, MODEL_NAME, {})
            error = state.get("error")
            if error is not None:  # a tool or the environment failed (verifiers caught it): the episode fails
                raise EnvError(f"the verifiers rollout stopped on an error: {type(error).__name__}: {error}")
            await self.env.rubric.score_rollout(state)
            await self.env.rubric.cleanup(state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the environment's own code: its error is this episode's
            await self.events.put(Failed(exc))
            return
        await self.events.put(Finished(state))
