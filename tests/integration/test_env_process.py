"""The environment's child process: a hanging or crashing environment costs its episodes, never the actor (issue 28)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvCalls
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.tasks.env_module import EnvSetup

ENV = '''
import asyncio, os, time

class Moody:
    def __init__(self, env_config, extras):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        if action == "hang":
            while True:
                time.sleep(0.01)
        if action == "die":
            os._exit(3)
        if action == "block":  # a hang no timer can interrupt: one call into C
            time.sleep(3600)
        if action.startswith("slow"):  # a tool that takes time: a search, an interpreter, a judge
            time.sleep(float(action[4:]))
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


class Awaiting(Moody):
    async def step(self, action):
        await asyncio.sleep(float(action))
        return {"observations": [], "reward": float(action), "done": True, "metadata": {}}
'''
PROMPT = [{"role": "user", "content": "hi"}]


def _calls(episode: int, action: str) -> EnvCalls:
    return EnvCalls([EnvCall(episode, "init", ({}, PROMPT)), EnvCall(episode, "step", action)])


def test_hangs_and_crashes_fail_their_episodes_and_a_fresh_process_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "moody.py"
    path.write_text(ENV)
    process = EnvProcess(EnvSetup(module=str(path), class_name="Moody", timeout_seconds=0.5))
    try:
        init, hung = process.run_envs(_calls(1, "hang"))
        assert init.failure is None and hung.failure == "timeout" and "0.5s" in hung.detail
        _, fine = process.run_envs(_calls(2, "ok"))
        assert fine.step is not None and fine.step.reward == 1.0 and process.restarts == 0
        answers = process.run_envs(_calls(3, "die"))
        assert [a.failure for a in answers] == ["crashed", "crashed"] and "died" in answers[0].detail
        _, after = process.run_envs(_calls(4, "ok"))
        assert after.step is not None and after.step.done and process.restarts == 1
        (lost,) = process.run_envs(EnvCalls([EnvCall(2, "step", "ok")]))
        assert lost.failure == "lost"  # episode 2 lived in the process that died
    finally:
        process.close()


def test_a_deadline_kills_a_hang_and_close_from_another_thread_ends_a_batch_at_once(tmp_path: Path) -> None:
    """The learner's replay (issue 39, item 1): a batch waited on no longer than the caller's deadline, and a stop
    that does not wait for the batch in flight."""
    path = tmp_path / "moody.py"
    path.write_text(ENV)
    process = EnvProcess(EnvSetup(module=str(path), class_name="Moody", timeout_seconds=30.0))
    try:
        started = time.monotonic()
        init, hung = process.run_envs(_calls(1, "block"), max_seconds=1.0)  # the batch's own deadline: 62 s
        assert time.monotonic() - started < 5
        assert init.failure is None and hung.failure == "timeout" and "killed" in hung.detail  # init had answered
        in_flight: list[list[EnvAnswer]] = []
        worker = threading.Thread(target=lambda: in_flight.append(process.run_envs(_calls(2, "block"))))
        worker.start()
        time.sleep(2.0)  # the fresh child is blocked in the step (or, on a busy machine, still starting)
        stopping = time.monotonic()
        process.close()
        worker.join(timeout=10)
        assert not worker.is_alive() and time.monotonic() - stopping < 5
        assert in_flight[0][1].failure == "crashed" and "closed" in in_flight[0][1].detail
        (after,) = process.run_envs(EnvCalls([EnvCall(3, "init", ({}, PROMPT))]))
        assert after.failure == "crashed" and "closed" in after.detail and process.child.pid is None  # none restarted
    finally:
        process.close()


@contextlib.contextmanager
def _moody(tmp_path: Path, class_name: str = "Moody", **setup: Any) -> Iterator[EnvProcess]:
    path = tmp_path / "moody.py"
    path.write_text(ENV)
    process = EnvProcess(EnvSetup(module=str(path), class_name=class_name, **setup))
    try:
        yield process
    finally:
        process.close()


def _inits(episodes: range) -> EnvCalls:
    return EnvCalls([EnvCall(e, "init", ({}, PROMPT)) for e in episodes])


def _collected(process: EnvProcess, count: int, within: float) -> list[EnvAnswer]:
    answers: list[EnvAnswer] = []
    deadline = time.monotonic() + within
    while len(answers) < count and time.monotonic() < deadline:
        answers += process.collect(0.05)
    return answers


def test_slow_tools_run_side_by_side_and_a_fast_episode_is_answered_first(tmp_path: Path) -> None:
    """Issue 40, item 1: a call that takes a second holds its own episode, not the others'."""
    with _moody(tmp_path, timeout_seconds=10.0, concurrency=8) as process:
        assert all(a.failure is None for a in process.run_envs(_inits(range(9))))  # episodes 0-8
        started = time.monotonic()
        # Eight calls at once, as many as the process runs side by side: seven slow tools, then an instant one.
        process.submit(EnvCalls([EnvCall(e, "step", "slow1.0") for e in range(7)] + [EnvCall(8, "step", "ok")]))
        first = _collected(process, 1, 5.0)
        assert [a.episode for a in first] == [8], "the instant step must not wait behind the slow ones"
        rest = _collected(process, 7, 10.0)
        seconds = time.monotonic() - started
        assert sorted(a.episode for a in rest) == list(range(7)) and all(a.step is not None for a in rest)
        assert seconds < 4.0, f"7 one-second calls side by side took {seconds:.1f}s (one at a time: 7 s)"


def test_an_async_step_is_awaited_and_an_episodes_calls_keep_their_order(tmp_path: Path) -> None:
    with _moody(tmp_path, "Awaiting", timeout_seconds=0.5) as process:
        # init, then two steps of the same episode in one batch: the second may not start before the first ends.
        answers = process.run_envs(EnvCalls([EnvCall(1, "init", ({}, PROMPT)), EnvCall(1, "step", "0.2"),
                                             EnvCall(1, "step", "0.0"), EnvCall(2, "init", ({}, PROMPT)),
                                             EnvCall(2, "step", "5")]))
        assert [a.step.reward if a.step else a.failure for a in answers[1:3]] == [0.2, 0.0]
        assert answers[4].failure == "timeout" and process.restarts == 0  # the coroutine was cancelled, not the process


def test_a_call_stuck_in_c_times_out_alone_and_the_others_go_on(tmp_path: Path) -> None:
    with _moody(tmp_path, timeout_seconds=1.0) as process:
        process.run_envs(_inits(range(2)))
        stuck, fine = process.run_envs(EnvCalls([EnvCall(0, "step", "block"), EnvCall(1, "step", "ok")]))
        assert stuck.failure == "timeout" and "1s" in stuck.detail and fine.step is not None
        (later,) = process.run_envs(_inits(range(5, 6)))
        assert later.failure is None and process.restarts == 0  # its thread was written off, the process kept


SLOW_LOADING_ENV = '''
import os, time
if os.path.exists(os.environ["GRPO_FLEET_TEST_MARKER"]):  # from the second child on: a slow import
    time.sleep(2.5)
''' + ENV


def test_a_batch_deadline_runs_from_when_the_child_has_the_batch(tmp_path: Path, monkeypatch) -> None:
    """A fresh child's start is not the calls' time: a restart slower than the batch's deadline (a loaded machine,
    a heavy import) once failed the batch that started it as a timeout."""
    path, marker = tmp_path / "slow_moody.py", tmp_path / "slow"
    path.write_text(SLOW_LOADING_ENV)
    monkeypatch.setenv("GRPO_FLEET_TEST_MARKER", str(marker))  # the spawned children inherit it
    process = EnvProcess(EnvSetup(module=str(path), class_name="Moody", timeout_seconds=0.5))
    try:
        assert [a.failure for a in process.run_envs(_calls(1, "die"))] == ["crashed", "crashed"]
        marker.touch()
        init, step = process.run_envs(_calls(2, "ok"), max_seconds=2.0)  # the restart alone takes over 2.5 s
        assert init.failure is None and step.step is not None and process.restarts == 1
    finally:
        process.close()


def test_the_calls_a_dead_child_held_fail_when_the_next_batch_restarts_it(tmp_path: Path) -> None:
    """A child that died while its calls waited, found dead by the next submit: those calls fail at once, and the
    fresh child is kept (they once waited out the silence deadline, which then killed the fresh child too)."""
    with _moody(tmp_path, timeout_seconds=5.0) as process:
        assert process.run_envs(_inits(range(1, 2)))[0].failure is None
        process.submit(EnvCalls([EnvCall(1, "step", "die")]))
        deadline = time.monotonic() + 10
        while process.child.running and time.monotonic() < deadline:
            time.sleep(0.02)
        process.submit(_inits(range(2, 3)))
        answers = {a.episode: a for a in _collected(process, 2, within=5.0)}
        assert answers[1].failure == "crashed" and "died" in answers[1].detail and answers[2].failure is None
        assert process.restarts == 1 and process.child.running
