"""runtime/run_lock.py: one learner per run directory (flock conflicts between two opens, in one process too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpo_fleet.runtime.run_lock import LOCK_FILE, RunDirLock, RunDirLocked


def test_a_second_holder_is_refused_with_the_pid_of_the_first_until_it_lets_go(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(RunDirLocked, match=rf"run directory {run_dir} is in use by another learner "
                                               rf"\(pid {os.getpid()}\)"):
            RunDirLock(run_dir).acquire()
    with RunDirLock(run_dir):  # released: the next learner takes it
        pass


def test_a_lock_file_left_by_a_dead_learner_holds_nothing(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("999999\n")  # what a crashed learner leaves: a pid, no lock
    with RunDirLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
