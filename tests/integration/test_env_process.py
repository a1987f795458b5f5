"""The environment's child process: a hanging or crashing environment costs its episodes, never the actor (issue 28)."""

from __future__ import annotations

from pathlib import Path

from grpo_fleet.envs.hosting import EnvCall, EnvCalls
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.tasks.env_module import EnvSetup

ENV = '''
import os, time

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
