"""The environment's child process: a hanging or crashing environment costs its episodes, never the actor (issue 28)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvCalls
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.tasks.env_module import EnvSetup

ENV = '''
import os, signal, time

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
        if action == "block":  # a hang the per-call timer cannot end (its signal blocked, as C code may)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}
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
        assert init.failure == hung.failure == "timeout" and "killed" in hung.detail
        in_flight: list[list[EnvAnswer]] = []
        worker = threading.Thread(target=lambda: in_flight.append(process.run_envs(_calls(2, "block"))))
        worker.start()
        time.sleep(2.0)  # the fresh child is blocked in the step (or, on a busy machine, still starting)
        stopping = time.monotonic()
        process.close()
        worker.join(timeout=10)
        assert not worker.is_alive() and time.monotonic() - stopping < 5
        assert [a.failure for a in in_flight[0]] == ["crashed", "crashed"] and "closed" in in_flight[0][0].detail
        (after,) = process.run_envs(EnvCalls([EnvCall(3, "init", ({}, PROMPT))]))
        assert after.failure == "crashed" and "closed" in after.detail and process.child is None  # none restarted
    finally:
        process.close()
