"""What the console shows when a fleet child dies, and which model directories the fleet's actors may load."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import local_model_path
from grpo_fleet.launch.local_fleet import (
    TAIL_BYTES,
    TAIL_LINE_CHARS,
    FleetStop,
    actor_args,
    actor_model_dirs,
    exit_status,
    log_tail,
)


def test_log_tail_keeps_the_last_lines_and_skips_blank_ones(tmp_path: Path) -> None:
    log = tmp_path / "actor-0.log"
    log.write_text("".join(f"line {i}\n\n" for i in range(30)) + "grpo-fleet actor: refusing to run: why\n\n")
    assert log_tail(log, lines=3) == ("line 28", "line 29", "grpo-fleet actor: refusing to run: why")


def test_log_tail_escapes_what_would_drive_a_terminal(tmp_path: Path) -> None:
    log = tmp_path / "actor-0.log"
    log.write_bytes("model '/m/\x1b[2J\u00e9'\trefused\x07\r\nnext line\n".encode() + b"\xff\n")
    assert log_tail(log) == ("model '/m/\\x1b[2J\\xe9'\\x09refused\\x07", "next line", "\\ufffd")


def test_log_tail_reads_a_bounded_end_of_a_huge_log(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_text("x" * (TAIL_BYTES * 4) + "\n" + "y" * (TAIL_LINE_CHARS * 3) + "\nTraceback end\n")
    tail = log_tail(log)
    assert tail[-1] == "Traceback end"
    assert tail[-2] == "y" * TAIL_LINE_CHARS + "..."
    assert sum(len(line) for line in tail) < TAIL_BYTES


def test_log_tail_of_a_missing_log_says_so(tmp_path: Path) -> None:
    (line,) = log_tail(tmp_path / "absent.log")
    assert line.startswith("(cannot read the log: ") and "absent.log" in line


def test_fleet_stop_names_the_child_its_exit_and_its_log(tmp_path: Path) -> None:
    stop = FleetStop("actor-1", 2, tmp_path / "actor-1.log", ("grpo-fleet actor: refusing to run: digest mismatch",))
    assert stop.describe().splitlines() == [
        f"actor-1 exited with code 2 before training finished; the last lines of {tmp_path / 'actor-1.log'}:",
        "  | grpo-fleet actor: refusing to run: digest mismatch",
    ]
    assert "(the log is empty)" in FleetStop("learner", 1, tmp_path / "learner.log", ()).describe()


@pytest.mark.parametrize(("code", "said"), [(1, "exited with code 1"), (-signal.SIGKILL, "was killed by SIGKILL")])
def test_exit_status_reads_codes_and_signals(code: int, said: str) -> None:
    assert exit_status(code) == said


def _cfg(tmp_path: Path, model_path: str) -> RunConfig:
    return RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "model": {"path": model_path}})


def test_actors_may_load_from_the_run_dir_and_a_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert actor_model_dirs(_cfg(tmp_path, "models/mine")) == [str(tmp_path / "run"), str(tmp_path / "models" / "mine")]


def test_the_fleets_actors_are_given_the_learners_model_dir_and_reward_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "model": {"path": "mine"},
                                    "task": {"reward_module": "my_rewards.py"}, "server": {"bind": "tcp://127.0.0.1:5999"}})
    args = actor_args(cfg, 1, 9411)
    assert args[:9] == ["actor", "--connect", "tcp://127.0.0.1:5999", "--actor-id", "demo-actor-1",
                        "--metrics-port", "9411", "--max-groups", str(cfg.server.max_groups_per_lease)]
    assert args[9:] == ["--model-dir", str(tmp_path / "run"), "--model-dir", str(tmp_path / "mine"),
                        "--reward-module", "my_rewards.py"]


@pytest.mark.parametrize("model_path", ["tiny", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"])
def test_a_hub_id_or_the_tiny_model_adds_no_directory(tmp_path: Path, model_path: str) -> None:
    assert actor_model_dirs(_cfg(tmp_path, model_path)) == [str(tmp_path / "run")]


def test_the_demo_makes_a_model_directory_absolute_and_leaves_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    assert local_model_path("mine") == str(tmp_path / "mine")
    assert local_model_path("link") == str(tmp_path / "mine")  # as the actors' admission resolves it
    assert local_model_path("org/model") == "org/model"
