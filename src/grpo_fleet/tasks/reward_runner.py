"""Running rewards: in a child process with timeouts (actors, the learner's checks), or inline (tests, offline eval).

A reward is user code: it may raise, hang, or never return from a C call. The
child process (runtime/child.py's guarded child) gives every call `timeout_seconds`
by a SIGALRM timer, which interrupts Python code (sympy included); a call that
blocks the timer too is caught by the parent's hard deadline, which kills the
child and starts a new one. Either way the group is unscorable and the caller goes on: a reward never
crashes the process that asked for it. The policy for what a failure means is
tasks/scoring.py's.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Union

from grpo_fleet.runtime.child import CallTimedOut, ChildDied, ChildRefused, ChildSilent, ChildSpec, GuardedChild, call_deadline
from grpo_fleet.tasks.reward_module import RewardModuleError, load_rewards
from grpo_fleet.tasks.rewards import RewardFn, UnknownRewardError
from grpo_fleet.tasks.scoring import GroupScore, RewardError, RewardFailure, ScoringJob, checked_value, group_score

# Added to a group's summed timeouts before the parent kills the child: pickling and scheduling.
HARD_DEADLINE_SLACK_SECONDS = 2.0
DETAIL_CHARS = 300


@dataclass(frozen=True)
class RewardSet:
    """What to score with: the run's rewards (Welcome's RewardSpec, or the task's), picklable for the child."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    module: Optional[str] = None  # task.reward_module, as this machine reaches it
    timeout_seconds: float = 10.0
    bound: float = 1e4


class RewardsRefused(ChildRefused):
    """The rewards cannot be loaded here: a missing module, an import error, an unknown name."""


def _load_functions(rewards: RewardSet) -> list[RewardFn]:
    """The rewards' functions, here; RewardsRefused when they cannot be loaded."""
    try:
        return load_rewards(rewards.names, rewards.module)
    except (RewardModuleError, UnknownRewardError) as exc:
        raise RewardsRefused(str(exc)) from exc


Outcome = Union[Optional[float], RewardFailure]
Call = Callable[[RewardFn, str, ScoringJob], Any]


def score_job(rewards: RewardSet, functions: Sequence[RewardFn], job: ScoringJob, call: Call) -> GroupScore:
    """Every reward on every completion of one group, through `call`, then the group's score."""
    seconds = dict.fromkeys(rewards.names, 0.0)
    per_completion: list[list[Outcome]] = []
    for completion in job.completions:
        outcomes: list[Outcome] = []
        for name, fn in zip(rewards.names, functions):
            started = time.perf_counter()
            outcomes.append(_outcome(name, fn, completion, job, call, rewards))
            seconds[name] += time.perf_counter() - started
            if isinstance(outcomes[-1], RewardFailure):
                return GroupScore(failure=outcomes[-1], seconds=seconds)
        per_completion.append(outcomes)
    return group_score(per_completion, rewards.weights, rewards.bound, seconds)


def _outcome(name: str, fn: RewardFn, completion: str, job: ScoringJob, call: Call, rewards: RewardSet) -> Outcome:
    started = time.perf_counter()
    try:
        value = call(fn, completion, job)
    except CallTimedOut:
        return RewardFailure(name, RewardError.TIMEOUT, f"ran past {rewards.timeout_seconds:g}s (task.reward_timeout_seconds)")
    except Exception as exc:  # the user's code: every error is counted and reported, none crashes us
        return RewardFailure(name, RewardError.EXCEPTION, f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS])
    if time.perf_counter() - started > rewards.timeout_seconds:  # inline calls cannot be interrupted
        return RewardFailure(name, RewardError.TIMEOUT, f"took over {rewards.timeout_seconds:g}s (task.reward_timeout_seconds)")
    return checked_value(name, value, rewards.bound)


def plain_call(fn: RewardFn, completion: str, job: ScoringJob) -> Any:
    """Call a reward with the one signature; an async reward is run to completion."""
    value = fn(completion, job.prompt, **job.columns)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class InlineScorer:
    """Rewards called in this process: no timeout can interrupt them, though over-time calls still fail."""

    def __init__(self, rewards: RewardSet) -> None:
        self.rewards = rewards
        self.functions = _load_functions(rewards)

    def score(self, jobs: Sequence[ScoringJob]) -> list[GroupScore]:
        return [score_job(self.rewards, self.functions, job, plain_call) for job in jobs]

    def close(self) -> None:
        """Nothing to release (the same interface as ScoringProcess)."""


# ---------------------------------------------------------------------- the child process (runtime/child.py)


def _load(rewards: RewardSet) -> tuple[RewardSet, list[RewardFn]]:
    return rewards, _load_functions(rewards)


def _serve(conn: Connection, loaded: tuple[RewardSet, list[RewardFn]]) -> None:
    """The child's loop: score each batch of jobs, one answer per job, each call under the timer."""
    rewards, functions = loaded
    timed = functools.partial(_timed_call, rewards.timeout_seconds)
    while True:
        for job in conn.recv():
            conn.send(score_job(rewards, functions, job, timed))


def _timed_call(seconds: float, fn: RewardFn, completion: str, job: ScoringJob) -> Any:
    with call_deadline(seconds):
        return plain_call(fn, completion, job)


class ScoringProcess:
    """Rewards in a guarded child process (runtime/child.py), restarted after a hard kill or a death."""

    def __init__(self, rewards: RewardSet) -> None:
        self.rewards = rewards
        self.child = GuardedChild(ChildSpec("grpo-fleet-rewards", "the reward process", "the rewards", _load, _serve,
                                            rewards, refused=RewardsRefused))

    @property
    def restarts(self) -> int:
        return self.child.restarts

    def score(self, jobs: Sequence[ScoringJob]) -> list[GroupScore]:
        """One GroupScore per job, in order; a child that hangs or crashes on a job costs that job, then is replaced.

        A child found dead before a batch (killed while idle: the OOM killer, a stop signal to its process
        group) costs no job: a fresh one takes the batch. Nor does one stopped from outside during a job
        (SIGTERM, SIGHUP): that job goes to a fresh child, once.
        """
        results: list[GroupScore] = []
        pending = list(jobs)
        retried = False  # pending[0] already went to a fresh child after an outside stop
        while pending:
            refusal = self._hand_over(pending)
            if refusal is not None:  # no child would start: every job left is unscorable, none crashes us
                return results + [GroupScore(failure=RewardFailure("*", RewardError.CRASHED, refusal))
                                  for _ in pending]
            while pending and self.child.pid is not None:  # none held once it was killed or found dead
                answer = self._receive(pending[0])
                if answer is None and not retried:
                    retried = True  # the child is gone: the outer loop hands the rest to a fresh one
                    continue
                results.append(answer or GroupScore(failure=RewardFailure(
                    "*", RewardError.CRASHED, "the reward process was stopped from outside twice on this group")))
                pending.pop(0)
                retried = False
        return results

    def _hand_over(self, jobs: list[ScoringJob]) -> Optional[str]:
        """Send `jobs` to a live child, starting a fresh one when there is none; why none took them, or None."""
        for _ in range(2):  # a child that dies between the check and the send gets one successor
            try:
                if not self.child.running:
                    self.child.restart()
                self.child.send(jobs)
                return None
            except RewardsRefused as exc:
                return f"the reward process could not be restarted: {exc}"[:DETAIL_CHARS]
            except ChildDied:
                continue
        return "the reward process died as soon as it was started, twice"

    def _receive(self, job: ScoringJob) -> Optional[GroupScore]:
        """The child's answer for `job`, a failure charged to it, or None: stopped from outside, not by the job."""
        calls = max(1, len(job.completions) * len(self.rewards.names))
        deadline = calls * self.rewards.timeout_seconds + HARD_DEADLINE_SLACK_SECONDS
        try:
            answer: GroupScore = self.child.receive(deadline)
            return answer
        except ChildSilent:
            detail = f"no answer within {deadline:g}s (a reward blocked its own timeout); the process was restarted"
            error = RewardError.TIMEOUT
        except ChildDied as died:
            if died.stopped_from_outside:
                return None
            detail, error = "the reward process died (a reward crashed it); it was restarted", RewardError.CRASHED
        return GroupScore(failure=RewardFailure("*", error, detail))

    def close(self) -> None:
        self.child.close()


Scorer = Union[InlineScorer, ScoringProcess]
