"""`grpo-fleet demo` on the user's own model directory, and a demo whose fleet loses a process.

The demo runs as the user runs it, a `grpo-fleet demo` process with its real
learner and actors. A fleet that loses a process must stop within seconds, say
why on the console and leave none of its processes behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from grpo_fleet.runtime.blas import child_env
from helpers import LENGTHS_ENV

# Measured on 2 cores: a failing demo ends 1.7 s after its first child exits, and
# 10-35 s after it starts (busy cores), most of it the learner's start.
REACTS_WITHIN_SECONDS = 8.0
FAILS_WITHIN_SECONDS = 60.0
HARD_LIMIT_SECONDS = 180.0
# A smaller held-out set than the demo's 128 prompts: the evaluations are not what is tested.
EVAL_PROMPTS = 16


@dataclass
class DemoRun:
    returncode: int
    output: str
    seconds: float
    children: set[int]  # every learner and actor pid seen while it ran
    reaction: Optional[float]  # seconds from the first child's exit to the demo's own
    survivors: set[int]  # those still alive once the demo had exited, and any other naming its run dir


def _fleet_pids(run_dir: Path, demo_pid: int) -> set[int]:
    """Live processes whose command line names this run directory (the demo's learner and actors)."""
    # -ww: the whole command line, whatever COLUMNS says (pytest sets it).
    table = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    pids = set()
    for line in table.splitlines():
        pid, _, args = line.strip().partition(" ")
        if str(run_dir.resolve()) in args and int(pid) != demo_pid:
            pids.add(int(pid))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_demo(cwd: Path, model_path: str, steps: int, extra: tuple[str, ...] = ()) -> DemoRun:
    """`grpo-fleet demo --set model.path=MODEL_PATH [EXTRA]` from `cwd`, watching which children it starts."""
    run_dir = cwd / "demo"
    out = cwd / "demo.out"
    args = [sys.executable, "-m", "grpo_fleet", "demo", "--steps", str(steps), "--run-dir", str(run_dir),
            "--no-progress", "--set", f"model.path={model_path}", "--set", f"task.num_eval={EVAL_PROMPTS}", *extra]
    started = time.monotonic()
    with open(out, "w") as sink:
        demo = subprocess.Popen(args, cwd=cwd, env=child_env(), stdout=sink, stderr=subprocess.STDOUT)
    children: set[int] = set()
    first_exit: Optional[float] = None
    try:
        while demo.poll() is None and time.monotonic() - started < HARD_LIMIT_SECONDS:
            running = _fleet_pids(run_dir, demo.pid)
            if first_exit is None and children - running:
                first_exit = time.monotonic()
            children |= running
            time.sleep(0.2)
    finally:
        ended = time.monotonic()
        seconds = ended - started
        _stop_overrun(demo)
        survivors = {pid for pid in children if _alive(pid)} | _fleet_pids(run_dir, demo.pid)
        for pid in survivors:  # the test fails on them; they are not to outlive it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    reaction = None if first_exit is None else ended - first_exit
    return DemoRun(demo.returncode, out.read_text(), seconds, children, reaction, survivors)


def _stop_overrun(demo: subprocess.Popen) -> None:
    if demo.poll() is None:
        demo.terminate()  # the demo stops its fleet on SIGTERM
        try:
            demo.wait(timeout=20)
        except subprocess.TimeoutExpired:
            demo.kill()
    demo.wait()


def assert_nothing_left(run: DemoRun) -> None:
    assert len(run.children) >= 3, f"saw only {run.children}: the learner and two actors should have run"
    assert not run.survivors, run.output


def test_demo_trains_on_a_model_directory_given_by_a_relative_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "my-model")
    run = run_demo(tmp_path, "my-model", steps=5)
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["steps"] == 5, run.output
    assert run.returncode == (0 if summary["ok"] else 1), run.output  # ok: the held-out reward rose
    learner_log = (tmp_path / "demo" / "learner.log").read_text()
    assert f"learner ready: model {(tmp_path / 'my-model').resolve()}," in learner_log
    for actor in ("actor-0", "actor-1"):
        assert "joined run" in (tmp_path / "demo" / f"{actor}.log").read_text(), run.output
    assert_nothing_left(run)


@pytest.mark.parametrize(("extra_file", "target", "who", "reason"), [
    # /proc/self reads differently in each process, so the learner's digest of the
    # directory and the actors' differ, as when a file is rewritten while the fleet
    # starts: every actor refuses the model.
    pytest.param("provenance.json", "/proc/self/cmdline", "actor-", "differs from the learner's (digest mismatch)",
                 marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")),
    # A dangling link is no file the demo's own evaluation reads, but the learner's
    # digest of the directory opens it and the learner dies with a traceback.
    ("notes.json", "missing/notes.json", "learner", "FileNotFoundError"),
])
def test_demo_stops_with_the_reason_when_a_process_exits(
    tmp_path: Path, tiny_model_dir: Path, extra_file: str, target: str, who: str, reason: str
) -> None:
    model = tmp_path / "their-model"
    shutil.copytree(tiny_model_dir, model)
    (model / extra_file).symlink_to(target if target.startswith("/") else tmp_path / target)
    run = run_demo(tmp_path, str(model), steps=1000)
    assert run.returncode == 1, run.output
    assert run.seconds < FAILS_WITHIN_SECONDS, run.output
    assert run.reaction is not None and run.reaction < REACTS_WITHIN_SECONDS, run
    assert f"the demo stopped: {who}" in run.output and reason in run.output, run.output
    assert "held-out reward:" not in run.output  # no summary of a run that did not happen
    assert_nothing_left(run)


def users_episode_config(folder: Path, env_source: str) -> None:
    """What docs/environments.md has a user write: an environment file beside their config."""
    folder.mkdir()
    (folder / "lengths.py").write_text(env_source)
    demos = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"
    (folder / "my.toml").write_text(f"""
[task]
name = "jsonl"
train_path = "{demos / 'capitals_train.jsonl'}"
eval_path = "{demos / 'capitals_eval.jsonl'}"
rewards = []
chat_template = true
env = "lengths.py:Lengths"
max_turns = 2
max_episode_tokens = 160

[generation]
group_size = 4
max_tokens = 6
""")


def test_demo_trains_a_users_environment_file_beside_its_config(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    # The env file lies outside the run directory and is no installed module: the demo's own actors must be allowed
    # it, as they are the reward module (they refused it as "outside the allowed directories").
    project = tmp_path / "project"
    users_episode_config(project, LENGTHS_ENV)
    run = run_demo(project, str(tiny_chat_model_dir), steps=2, extra=("--config", "my.toml"))
    assert "outside the allowed directories" not in run.output, run.output
    summary = json.loads((project / "demo" / "summary.json").read_text())
    assert summary["steps"] == 2, run.output
    for actor in ("actor-0", "actor-1"):
        assert "joined run" in (project / "demo" / f"{actor}.log").read_text(), run.output
    assert_nothing_left(run)


def test_demo_refuses_an_environment_it_cannot_verify_in_one_line(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    project = tmp_path / "project"
    users_episode_config(project, LENGTHS_ENV.replace("    deterministic = True\n", ""))
    run = run_demo(project, str(tiny_chat_model_dir), steps=2, extra=("--config", "my.toml"))
    assert run.returncode == 2, run.output
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and "does not declare itself deterministic" in lines[0], run.output
    assert not run.children, "refused before any learner or actor started"
