"""Where environments live: one object per episode, driven by batches of calls, each call under a timeout.

On an actor the host runs in a child process beside the rewards' (envs/process.py),
so a hanging or crashing environment costs its episodes, never the actor.
`InlineEnvs` runs the same host in this process (tests and benches; the
learner replays deterministic environments in a child process too). Every failure is an answer with its kind, never
an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from grpo_fleet.envs.protocol import EnvError, StepResult, checked_init, checked_step
from grpo_fleet.tasks.env_module import EnvSetup, load_env_class

# Added to a batch's summed timeouts before the parent gives up on the child: pickling and scheduling.
BATCH_SLACK_SECONDS = 2.0
DETAIL_CHARS = 300

CallKind = Literal["init", "step", "close"]
FailureKind = Literal["exception", "timeout", "interface", "crashed", "lost"]


@dataclass(frozen=True)
class EnvCall:
    """One call for one episode: init (payload: (extras, prompt messages)), step (the action text) or close."""

    episode: int
    kind: CallKind
    payload: Any = None


@dataclass(frozen=True)
class EnvCalls:
    """A batch of calls, in order: one round trip to the child process."""

    calls: list[EnvCall]


@dataclass(frozen=True)
class EnvAnswer:
    """What one call gave: init's conversation or a step's result; or why the episode failed."""

    episode: int
    conversation: Optional[list[dict[str, Any]]] = None
    step: Optional[StepResult] = None
    failure: Optional[FailureKind] = None
    detail: str = ""
    seconds: float = 0.0


class EnvTimeout(Exception):
    """A call ran past its timeout (raised by the guard that runs it)."""


Guard = Callable[[Callable[[], Any]], Any]  # runs a call under the timeout, raising EnvTimeout past it


async def as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def inline_guard(timeout_seconds: float) -> Guard:
    """Calls in this process cannot be interrupted; one that took too long still fails. An `async def` method's
    coroutine is run to its end here."""

    def guard(call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        value = call()
        if inspect.isawaitable(value):
            value = asyncio.run(as_coroutine(value))
        if time.perf_counter() - started > timeout_seconds:
            raise EnvTimeout(f"took over {timeout_seconds:g}s (task.env_timeout_seconds)")
        return value

    return guard


def batch_deadline(calls: EnvCalls, timeout_seconds: float) -> float:
    """How long the parent waits for a batch's answers before it kills the child."""
    return len(calls.calls) * timeout_seconds + BATCH_SLACK_SECONDS


def lost(calls: EnvCalls, detail: str, kind: FailureKind = "crashed") -> list[EnvAnswer]:
    """Every call of a batch failed together: the process hosting the environments died ("crashed") or hung
    ("timeout")."""
    return [EnvAnswer(call.episode, failure=kind, detail=detail) for call in calls.calls]


class EnvHost:
    """The live environments of the episodes in progress, by episode id."""

    def __init__(self, setup: EnvSetup) -> None:
        self.setup = setup
        self.env_class = load_env_class(setup.module, setup.class_name)
        self.live: dict[int, Any] = {}

    def run(self, calls: EnvCalls, guard: Guard) -> list[EnvAnswer]:
        return [self.answer(call, guard) for call in calls.calls]

    def answer(self, call: EnvCall, guard: Guard) -> EnvAnswer:
        """One call's answer (or its failure), timed; a failed episode's environment is dropped."""
        started = time.perf_counter()
        try:
            answer = self._answer(call, guard)
        except EnvTimeout as exc:
            answer = EnvAnswer(call.episode, failure="timeout", detail=str(exc))
        except EnvError as exc:
            answer = EnvAnswer(call.episode, failure="interface", detail=str(exc)[:DETAIL_CHARS])
        except Exception as exc:  # the user's code: every error is its episode's, none crashes the host
            answer = EnvAnswer(call.episode, failure="exception", detail=f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS])
        if answer.failure is not None:
            self.live.pop(call.episode, None)
        return EnvAnswer(answer.episode, answer.conversation, answer.step, answer.failure, answer.detail,
                         time.perf_counter() - started)

    def _answer(self, call: EnvCall, guard: Guard) -> EnvAnswer:
        if call.kind == "init":
            extras, prompt = call.payload
            env = guard(lambda: self.env_class(self.setup.config, extras))
            self.live[call.episode] = env
            return EnvAnswer(call.episode, conversation=checked_init(guard(lambda: env.init(prompt))))
        env = self.live.get(call.episode)
        if env is None:
            return EnvAnswer(call.episode, failure="lost",
                             detail="no such episode here (the environment process was restarted)")
        if call.kind == "step":
            return EnvAnswer(call.episode, step=checked_step(guard(lambda: env.step(call.payload))))
        del self.live[call.episode]
        close = getattr(env, "close", None)
        if callable(close):
            guard(close)
        return EnvAnswer(call.episode)


class InlineEnvs:
    """Environments in this process: the same host, with calls timed but not interruptible, one at a time."""

    def __init__(self, setup: EnvSetup) -> None:
        self.host = EnvHost(setup)
        self.guard = inline_guard(setup.timeout_seconds)
        self._answered: list[EnvAnswer] = []

    def run_envs(self, calls: EnvCalls, max_seconds: Optional[float] = None) -> list[EnvAnswer]:
        """`max_seconds` cannot interrupt a call here; a caller that must stop a hang uses envs/process.EnvProcess."""
        return self.host.run(calls, self.guard)

    def submit(self, calls: EnvCalls) -> None:
        """Run the calls now (nothing here runs beside the caller); their answers wait for `collect`."""
        self._answered += self.host.run(calls, self.guard)

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]:
        answered, self._answered = self._answered, []
        return answered

    def close(self) -> None:
        self.host.live.clear()
