"""`grpo-fleet demo` takes the run directory's lock before it deletes anything there: with a learner holding
it, the demo is refused in one line and that learner's ledger.jsonl and metrics.jsonl are left whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.cli import main as cli
from grpo_fleet.launch import demo
from grpo_fleet.runtime.run_lock import RunDirLock


def _a_running_learners_files(run_dir: Path) -> dict[str, bytes]:
    run_dir.mkdir(parents=True)
    files = {"ledger.jsonl": b'{"group_id": "g1"}\n', "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    return files


def _no_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """demo_config's free ports bind sockets: not in a unit test."""
    monkeypatch.setattr(demo, "free_port", lambda: 1)
    monkeypatch.setattr(demo, "loopback_endpoint", lambda: "tcp://127.0.0.1:1")


def test_the_demo_is_refused_in_one_line_while_a_learner_holds_the_run_dir(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    files = _a_running_learners_files(run_dir)
    _no_ports(monkeypatch)
    with RunDirLock(run_dir):  # flock: a second open conflicts, in one process too (tests/unit/test_run_lock.py)
        code = cli.main(["demo", "--run-dir", str(run_dir), "--no-progress"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is in use by another learner" in lines[0] and str(run_dir) in lines[0]
    assert {name: (run_dir / name).read_bytes() for name in files} == files


def test_the_demo_holds_the_lock_while_it_clears_the_run_dir_and_lets_its_own_learner_take_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    _a_running_learners_files(run_dir)
    held: list[bool] = []

    def resolve(cfg: object, task: object) -> str:
        with pytest.raises(RuntimeError, match="in use"):  # the demo holds it while it prepares
            RunDirLock(run_dir).acquire()
        held.append(True)
        return str(tmp_path / "model")

    _no_ports(monkeypatch)
    monkeypatch.setattr("grpo_fleet.learner.run.build.resolve_model_path", resolve)
    cfg, config_path = demo.prepare(demo.DemoOptions(run_dir=str(run_dir)))
    assert held == [True] and config_path.is_file()
    assert not (run_dir / "ledger.jsonl").exists() and not (run_dir / "metrics.jsonl").exists()
    with RunDirLock(run_dir):  # released: the learner the demo starts next takes it
        pass
