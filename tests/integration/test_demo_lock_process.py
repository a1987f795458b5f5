"""`grpo-fleet demo` pointed at a run directory another process holds (a learner running there): refused in
one line, status 2, before it deletes anything; the holder's ledger.jsonl and metrics.jsonl stay whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from grpo_fleet.runtime.blas import child_env

# Holds the run directory's lock as a running learner does, until its stdin closes.
HOLDER = "import sys; from grpo_fleet.runtime.run_lock import RunDirLock; l = RunDirLock(sys.argv[1]); l.acquire(); " \
         "print('held', flush=True); sys.stdin.read()"


def test_the_demo_leaves_a_running_learners_run_dir_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = {"ledger.jsonl": b'{"group_id": "g1"}\n', "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        done = subprocess.run([sys.executable, "-m", "grpo_fleet", "demo", "--run-dir", str(run_dir), "--steps", "1",
                               "--no-progress"], capture_output=True, text=True, timeout=120, env=child_env())
    finally:
        holder.communicate(timeout=30)  # stdin closed: the holder exits
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and f"is in use by another learner (pid {holder.pid})" in lines[0]
    assert {name: (run_dir / name).read_bytes() for name in files} == files
