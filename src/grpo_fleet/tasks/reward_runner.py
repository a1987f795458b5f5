"""Running rewards: in a child process with timeouts (actors, the learner's checks), or inline (tests, offline eval).

A reward is user code: it may raise, hang, or never return from a C call. The
child process gives every call `timeout_seconds` by a SIGALRM timer, which
interrupts Python code (sympy included); a call that blocks the timer too is
caught by the parent's hard deadline, which kills the child and starts a new
one. Either way the group is unscorable and the caller goes on: a reward never
crashes the process that asked for it. The policy for what a failure means is
tasks/scoring.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Union

from grpo_fleet.tasks.reward_module import RewardModuleError, load_rewards
from grpo_fleet.tasks.rewards import RewardFn, UnknownRewardError
from grpo_fleet.tasks.scoring import GroupScore, RewardError, RewardFailure, ScoringJob, checked_value, group_score

log = logging.getLogger("grpo_fleet.rewards")
# How long a new child may take to import the rewards (math-verify brings sympy).
STARTUP_SECONDS = 120.0
# Added to a group's summed timeouts before the parent kills the child: pickling and scheduling.
HARD_DEADLINE_SLACK_SECONDS = 2.0
DETAIL_CHARS = 300
# A child that died of one of these was stopped from outside (a stop sent to its process group, a hangup),
# not by the job it held: that job is not charged, it goes to a fresh child.
STOPPED_FROM_OUTSIDE = (-signal.SIGTERM, -signal.SIGHUP)
STOP_REAP_SECONDS = 1.0
# Starts tried when a reward process is killed while it loads the rewards, before the rewards are refused.
START_ATTEMPTS = 3


@dataclass(frozen=True)
class RewardSet:
    """What to score with: the run's rewards (Welcome's RewardSpec, or the task's), picklable for the child."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    module: Optional[str] = None  # task.reward_module, as this machine reaches it
    timeout_seconds: float = 10.0
    bound: float = 1e4


class RewardsRefused(RuntimeError):
    """The rewards cannot be loaded here: a missing module, an import error, an unknown name."""


class _KilledWhileLoading(Exception):
    """The reward process died of a signal before it was ready: not the rewards' fault."""


class _RewardTimeout(BaseException):
    """Raised by the timer; a BaseException so a reward's own `except Exception` cannot swallow it."""


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
    except _RewardTimeout:
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
        try:
            self.functions = load_rewards(rewards.names, rewards.module)
        except (RewardModuleError, UnknownRewardError) as exc:
            raise RewardsRefused(str(exc)) from exc

    def score(self, jobs: Sequence[ScoringJob]) -> list[GroupScore]:
        return [score_job(self.rewards, self.functions, job, plain_call) for job in jobs]

    def close(self) -> None:
        """Nothing to release (the same interface as ScoringProcess)."""


# ---------------------------------------------------------------------- the child process


def _alarm(_signum: int, _frame: Any) -> None:
    raise _RewardTimeout()


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the child starts, so it inherits SIG_IGN from its first instruction on.

    Ctrl-C reaches the whole foreground process group: the reward process must not die of it
    before its parent (the actor or the learner) has shut down in order and stopped it. A spawned
    Python that starts with SIGINT ignored installs no KeyboardInterrupt handler of its own.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions can only change in the main thread; _serve ignores SIGINT itself
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _serve(conn: Connection, rewards: RewardSet) -> None:
    """The child's loop: load the rewards, then score each batch of jobs, one answer per job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops this process; Ctrl-C is the parent's to handle
    try:
        functions = load_rewards(rewards.names, rewards.module)
    except (RewardModuleError, UnknownRewardError) as exc:
        conn.send(("refused", str(exc)))
        return
    signal.signal(signal.SIGALRM, _alarm)

    def timed_call(fn: RewardFn, completion: str, job: ScoringJob) -> Any:
        signal.setitimer(signal.ITIMER_REAL, rewards.timeout_seconds)
        try:
            return plain_call(fn, completion, job)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    conn.send(("ready", ""))
    while True:
        try:
            jobs = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        try:
            for job in jobs:
                conn.send(score_job(rewards, functions, job, timed_call))
        except OSError:  # the parent went away while we scored: nobody to answer, and no traceback for its log
            return


class ScoringProcess:
    """Rewards in a child process (spawned: MLX and ZeroMQ state must not be forked), restarted after a hard kill."""

    def __init__(self, rewards: RewardSet) -> None:
        self.rewards = rewards
        self._context = multiprocessing.get_context("spawn")
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn: Optional[Connection] = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        """A child serving the rewards; RewardsRefused when the rewards themselves cannot be loaded.

        A child killed by a signal while it loads (the OOM killer, a stop to its process group) says
        nothing of the rewards: a fresh one is tried, up to START_ATTEMPTS in all.
        """
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except _KilledWhileLoading as exc:
                log.warning("the reward process was killed while loading the rewards (%s); attempt %d of %d",
                            exc, attempt, START_ATTEMPTS)
        raise RewardsRefused(f"the reward process was killed while loading the rewards, {START_ATTEMPTS} times")

    def _start_once(self) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child, self.rewards), daemon=True,
                                        name="grpo-fleet-rewards")
        with sigint_ignored():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(STARTUP_SECONDS):
            self._kill()
            raise RewardsRefused(f"the reward process did not start within {STARTUP_SECONDS:g}s")
        try:
            status, detail = parent.recv()
        except EOFError:
            process.join(timeout=STOP_REAP_SECONDS)  # the pipe closes as it dies: reap it for its exit code
            code = process.exitcode
            self._kill()
            if code is not None and code < 0:
                raise _KilledWhileLoading(f"signal {-code}") from None
            raise RewardsRefused(f"the reward process died while loading the rewards (exit code {code})") from None
        if status != "ready":
            self._kill()
            raise RewardsRefused(detail)

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
            while pending and self._conn is not None:
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
            if self._conn is None or self._process is None or not self._process.is_alive():
                if self._process is not None:  # it died since its last answer: say how, stopped or killed
                    code = self._process.exitcode
                    log.log(logging.INFO if code in STOPPED_FROM_OUTSIDE else logging.WARNING,
                            "the reward process had died (exit code %s); starting a fresh one", code)
                self._kill()
                try:
                    self._start()
                except RewardsRefused as exc:
                    return f"the reward process could not be restarted: {exc}"[:DETAIL_CHARS]
                self.restarts += 1
            assert self._conn is not None
            try:
                self._conn.send(jobs)
                return None
            except OSError:  # BrokenPipeError, ConnectionResetError: it died just now
                self._kill()
        return "the reward process died as soon as it was started, twice"

    def _receive(self, job: ScoringJob) -> Optional[GroupScore]:
        """The child's answer for `job`, a failure charged to it, or None: stopped from outside, not by the job."""
        assert self._conn is not None
        calls = max(1, len(job.completions) * len(self.rewards.names))
        deadline = calls * self.rewards.timeout_seconds + HARD_DEADLINE_SLACK_SECONDS
        try:
            if self._conn.poll(deadline):
                answer: GroupScore = self._conn.recv()
                return answer
            detail = f"no answer within {deadline:g}s (a reward blocked its own timeout); the process was restarted"
            error = RewardError.TIMEOUT
        except (EOFError, OSError):
            if self._stopped_from_outside():
                self._kill()
                return None
            detail, error = "the reward process died (a reward crashed it); it was restarted", RewardError.CRASHED
        self._kill()
        return GroupScore(failure=RewardFailure("*", error, detail))

    def _stopped_from_outside(self) -> bool:
        """Whether the child that just closed its pipe died of a stop signal rather than of the job it held."""
        assert self._process is not None
        self._process.join(timeout=STOP_REAP_SECONDS)  # the pipe closes as it dies: reap it for its exit code
        return self._process.exitcode in STOPPED_FROM_OUTSIDE

    def _kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._process, self._conn = None, None

    def close(self) -> None:
        self._kill()


Scorer = Union[InlineScorer, ScoringProcess]
