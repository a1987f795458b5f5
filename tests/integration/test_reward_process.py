"""Rewards in their own process (tasks/reward_runner.ScoringProcess): real child processes, real timeouts and kills."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_fleet.tasks.reward_runner import RewardSet, RewardsRefused, ScoringProcess
from grpo_fleet.tasks.scoring import RewardError, ScoringJob

USER_REWARDS = '''
import os
import signal
import time

def fine(completion, prompt, *, answer, **columns):
    return 1.0 if completion == answer else 0.0

def sleeps(completion, prompt, **columns):
    if completion == "hang":
        time.sleep(60)
    return 0.5

def swallows_everything(completion, prompt, **columns):
    try:
        time.sleep(60)
    except Exception:  # the timer's exception is not an Exception: this cannot hide it
        return 1.0

def blocks_the_timer(completion, prompt, **columns):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)

def crashes_the_process(completion, prompt, **columns):
    os._exit(3)
'''


@pytest.fixture
def module(tmp_path: Path) -> str:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def process(module: str, name: str, timeout: float = 0.5) -> ScoringProcess:
    return ScoringProcess(RewardSet(names=(name,), weights=(1.0,), module=module, timeout_seconds=timeout))


def job(*completions: str) -> ScoringJob:
    return ScoringJob(prompt="p", columns={"answer": "42"}, completions=list(completions))


def test_rewards_run_in_their_own_process(module: str) -> None:
    scorer = process(module, "fine")
    try:
        assert [s.rewards for s in scorer.score([job("42", "41"), job("42")])] == [[1.0, 0.0], [1.0]]
    finally:
        scorer.close()


def test_a_hanging_reward_times_out_and_the_next_group_is_scored(module: str) -> None:
    scorer = process(module, "sleeps")
    try:
        started = time.monotonic()
        hung, fine = scorer.score([job("ok", "hang"), job("ok")])
        assert hung.failure is not None and hung.failure.error is RewardError.TIMEOUT
        assert fine.rewards == [0.5] and scorer.restarts == 0, "the timer interrupted it: no kill needed"
        assert time.monotonic() - started < 5
    finally:
        scorer.close()


def test_a_reward_cannot_swallow_its_timeout(module: str) -> None:
    scorer = process(module, "swallows_everything")
    try:
        (result,) = scorer.score([job("x")])
        assert result.failure is not None and result.failure.error is RewardError.TIMEOUT
    finally:
        scorer.close()


def test_a_reward_that_blocks_the_timer_is_killed_at_the_hard_deadline(module: str) -> None:
    scorer = process(module, "blocks_the_timer", timeout=0.2)
    try:
        started = time.monotonic()
        first, second = scorer.score([job("x"), job("y")])
        for result in (first, second):
            assert result.failure is not None and result.failure.error is RewardError.TIMEOUT
        assert scorer.restarts == 1, "the first hung child was killed and a fresh one took the next group"
        assert time.monotonic() - started < 30
    finally:
        scorer.close()


def test_a_reward_that_kills_its_process_fails_only_its_group(module: str, tmp_path: Path) -> None:
    scorer = process(module, "crashes_the_process")
    try:
        (result,) = scorer.score([job("x")])
        assert result.failure is not None and result.failure.error is RewardError.CRASHED
        assert scorer.restarts == 0
        (again,) = scorer.score([job("y")])
        assert again.failure is not None and scorer.restarts == 1
    finally:
        scorer.close()


def test_a_module_that_cannot_load_is_refused_with_its_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(RewardsRefused, match="RuntimeError: no GPU here"):
        process(str(broken), "anything")
    with pytest.raises(RewardsRefused, match="unknown reward 'nope'"):
        ScoringProcess(RewardSet(names=("nope",), weights=(1.0,)))


CTRL_C_SCRIPT = '''
import sys, time
from grpo_fleet.tasks.reward_runner import RewardSet, ScoringProcess
from grpo_fleet.tasks.scoring import ScoringJob

def main():
    scorer = ScoringProcess(RewardSet(names=("fine",), weights=(1.0,), module=sys.argv[1], timeout_seconds=5.0))
    job = ScoringJob(prompt="p", columns={"answer": "42"}, completions=("42",))
    try:  # entered before the line goes out: the test's Ctrl-C may land before print() returns
        print("child", scorer._process.pid, flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        # What an actor does on Ctrl-C: finish in order, which still needs its reward process.
        print("scored", scorer.score([job])[0].rewards, flush=True)
        scorer.close()

if __name__ == "__main__":  # spawn re-imports this file in the child
    main()
'''


def test_ctrl_c_leaves_the_reward_process_to_its_parent(tmp_path: Path) -> None:
    """Ctrl-C goes to the whole process group; the reward process must not die of it before its parent
    has shut down (it did, and actors died with BrokenPipeError on the next score)."""
    import os
    import signal
    import subprocess
    import sys

    module = tmp_path / "user_rewards.py"
    module.write_text(USER_REWARDS)
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(module)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("child "), first + proc.stderr.read() if proc.stderr else first
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "scored [1.0]" in out, out + err
    assert "BrokenPipeError" not in err and "EOFError" not in err, err
    assert proc.returncode == 0, err
