"""Rewards in their own process (tasks/reward_runner.ScoringProcess): real child processes, real timeouts and kills."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from grpo_fleet.tasks.reward_runner import RewardSet, RewardsRefused, ScoringProcess
from grpo_fleet.tasks.scoring import RewardError, ScoringJob
from helpers import jsonl, reward_children, scrape, wait_for

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

def marks_then_sleeps(completion, prompt, *, marker, **columns):
    if not os.path.exists(marker):  # the first try only: the test stops the process in this sleep
        open(marker, "w").close()
        time.sleep(30)
    return 0.25
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


def child_pid(scorer: ScoringProcess) -> int:
    assert scorer.child.pid is not None
    return scorer.child.pid


def _kill_and_wait(pid: int, signum: int) -> None:
    os.kill(pid, signum)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # dead, and reaped or a zombie: either way its pipe is closed
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ", 1)[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        except OSError:  # no /proc (macOS): signal 0 says whether it is still there
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} outlived signal {signum}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_reward_process_killed_while_idle_is_replaced_and_costs_no_group(module: str, signum: int) -> None:
    """The OOM killer, or a stop sent to the process group, between two calls: the next call once raised
    BrokenPipeError for ever (every Rollouts answered `internal` on the learner; an actor crashed)."""
    scorer = process(module, "fine")
    try:
        for killed in (1, 2):
            _kill_and_wait(child_pid(scorer), signum)
            assert [s.rewards for s in scorer.score([job("42"), job("41")])] == [[1.0], [0.0]]
            assert scorer.restarts == killed
    finally:
        scorer.close()


def _kill_when_marked(marker: Path, pid: int, signum: int) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signum)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_reward_process_stopped_during_a_group_hands_the_group_to_a_fresh_one(module: str, tmp_path: Path) -> None:
    """SIGTERM (a stop sent to the actor's process group) is not the group's doing: a fresh process scores it."""
    marker = tmp_path / "started"
    scorer = process(module, "marks_then_sleeps", timeout=60.0)
    try:
        killer = _kill_when_marked(marker, child_pid(scorer), signal.SIGTERM)
        jobs = [ScoringJob(prompt="p", columns={"marker": str(marker)}, completions=["a", "b"]) for _ in range(2)]
        assert [s.rewards for s in scorer.score(jobs)] == [[0.25, 0.25], [0.25, 0.25]]
        killer.join()
        assert scorer.restarts == 1
    finally:
        scorer.close()


def test_a_reward_process_sigkilled_during_a_group_charges_that_group_only(module: str, tmp_path: Path) -> None:
    """SIGKILL may be the OOM killer's answer to the reward itself: that group fails, the next is scored."""
    marker = tmp_path / "started"
    scorer = process(module, "marks_then_sleeps", timeout=60.0)
    try:
        killer = _kill_when_marked(marker, child_pid(scorer), signal.SIGKILL)
        jobs = [ScoringJob(prompt="p", columns={"marker": str(marker)}, completions=["a"]) for _ in range(2)]
        first, second = scorer.score(jobs)
        killer.join()
        assert first.failure is not None and first.failure.error is RewardError.CRASHED
        assert second.rewards == [0.25] and scorer.restarts == 1
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
import faulthandler, itertools, signal, sys, time
from grpo_fleet.tasks.reward_runner import RewardSet, ScoringProcess
from grpo_fleet.tasks.scoring import ScoringJob

def main():
    # What the test prints if this process ever waits past its Ctrl-C: its stacks (on SIGUSR1), how SIGINT
    # stood at its start (inherited ignored or blocked, it would never raise), and what it printed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    status = open("/proc/self/status").read() if sys.platform == "linux" else ""
    print("sigint", signal.getsignal(signal.SIGINT), *[l for l in status.splitlines() if l.startswith("Sig")],
          file=sys.stderr, flush=True)
    # As a terminal's foreground job has it. A suite started in the background (`make test &`, nohup, some CI
    # runners) hands every process SIGINT ignored, and a Python that starts so never raises KeyboardInterrupt:
    # that was this test's "hang" (it waited out its sleeps), once in a while, depending on how pytest was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scorer = ScoringProcess(RewardSet(names=("fine",), weights=(1.0,), module=sys.argv[1], timeout_seconds=5.0))
    job = ScoringJob(prompt="p", columns={"answer": "42"}, completions=("42",))
    scorer.score([job])  # the reward process is up and serving, as an actor's is when Ctrl-C comes
    try:  # entered before the line goes out: the test's Ctrl-C may land before print() returns
        print("child", scorer.child.pid, flush=True)
        # The Ctrl-C lands here, in C code that checks no signal (a scan: about 0.3 s). Python runs the
        # handler only at its next check, so a wait must check again soon: one sleep(60) here waited out
        # its 60 s (the test timed out after 30 s, once in a fresh-clone make test, when the Ctrl-C fell
        # between the last check and sleep's system call). Short sleeps each check on return.
        -1 in itertools.repeat(0, 10_000_000)
        for _ in range(1200):
            time.sleep(0.05)
    except KeyboardInterrupt:
        # What an actor does on Ctrl-C: finish in order, which still needs its reward process.
        print("scored", scorer.score([job])[0].rewards, "by", scorer.child.pid, flush=True)
        scorer.close()

if __name__ == "__main__":  # spawn re-imports this file in the child
    main()
'''


def test_ctrl_c_leaves_the_reward_process_to_its_parent(tmp_path: Path) -> None:
    """Ctrl-C goes to the whole process group; the reward process must not die of it before its parent
    has shut down (it did, and actors died with BrokenPipeError on the next score)."""
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
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # its stacks, to say where it waited
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"no exit within 30 s of Ctrl-C; stdout: {out!r}; stderr: {err[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"scored [1.0] by {first.split()[1]}" in out, "the same reward process scored it: " + out + err
    assert "BrokenPipeError" not in err and "EOFError" not in err, err
    assert proc.returncode == 0, err


SLOW_LOADING = '''
import os, time
MARKER = os.environ["GRPO_FLEET_TEST_MARKER"]
if not os.path.exists(MARKER):  # the first child only: the test kills it here, while it loads
    with open(MARKER, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)

def fine(completion, prompt, **columns):
    return 1.0
'''


def test_a_reward_process_killed_while_loading_is_replaced_not_refused(tmp_path: Path, monkeypatch) -> None:
    """A reward process SIGKILLed before it was ready (the OOM killer, a stop to its group) said nothing of the
    rewards: the actor refused the run for good over it (exit 2, seen under load in a fresh-clone make test)."""
    module, marker = tmp_path / "slow_rewards.py", tmp_path / "loading"
    module.write_text(SLOW_LOADING)
    monkeypatch.setenv("GRPO_FLEET_TEST_MARKER", str(marker))  # the spawned child inherits it

    def kill_while_loading() -> None:
        pid = wait_for(lambda: marker.exists() and marker.read_text(), "the first reward process loading")
        os.kill(int(pid), signal.SIGKILL)

    killer = threading.Thread(target=kill_while_loading)
    killer.start()
    scorer = ScoringProcess(RewardSet(names=("fine",), weights=(1.0,), module=str(module), timeout_seconds=5.0))
    killer.join()
    try:
        assert scorer.score([ScoringJob(prompt="p", columns={}, completions=("x",))])[0].rewards == [1.0]
        assert scorer.child.pid is not None and scorer.child.pid != int(marker.read_text())
    finally:
        scorer.close()


def _steps(run_dir: Path) -> int:
    return len(jsonl(run_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_reward_processes_killed_under_load_on_the_learner_and_an_actor(run_config, spawn, free_port) -> None:
    """The learner's reward process and an actor's, killed again and again while the fleet trains: training
    goes on, no submission is answered `internal`, and no process dies or leaves a traceback."""
    metrics_port = free_port()
    config, cfg = run_config(metrics={"port": metrics_port}, train={"steps": 100000},
                             security={"verify_rewards": True})
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actors = [spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"a{i}", "--metrics-port", "0",
                    "--model-dir", str(run_dir), name=f"actor{i}") for i in range(2)]
    everyone = [learner, *actors]
    wait_for(lambda: _steps(run_dir) >= 3, "3 steps before the kills", procs=everyone)
    kills = 0
    for round_, signum in enumerate([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL]):
        for parent in (learner, actors[0]):
            victims = wait_for(lambda p=parent: reward_children(p.pid), "a reward process to kill", procs=everyone)
            for pid in victims:
                os.kill(pid, signum)
                kills += 1
        reached = _steps(run_dir) + 2
        wait_for(lambda r=reached: _steps(run_dir) >= r, f"2 more steps after kill round {round_ + 1}",
                 procs=everyone)
    internal = scrape(metrics_port).total("grpo_fleet_learner_internal_errors_total")
    logs = {proc.log_path.name: proc.log_path.read_text() for proc in everyone}
    assert internal == 0, learner.log_path.read_text()[-3000:]
    for name, text in logs.items():
        assert "Traceback" not in text and "error handling" not in text, f"{name}: {text[-3000:]}"
    assert all(proc.poll() is None for proc in everyone)
    print(f"reward processes killed: {kills} (learner and actor a0), steps {_steps(run_dir)}, internal {internal:g}")
