"""What a learner claims, and says plainly when another process has it: its run directory, its addresses."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from grpo_fleet.runtime.blas import child_env
from helpers import wait_for


def _learner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_fleet", "learner", *args], capture_output=True, text=True,
                          env=child_env(), timeout=300)


def _one_line(result: subprocess.CompletedProcess) -> str:
    """A refusal: exit 2 and one line, the last, no traceback (the log lines of a learner built by then aside)."""
    said = [line for line in result.stderr.splitlines() if line.startswith("grpo-fleet learner:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(said) == 1 and result.stderr.rstrip().endswith(said[0]), result.stderr[-3000:]
    return said[0]


def test_a_second_learner_on_a_run_directory_in_use_is_refused_with_the_holders_pid(run_config, spawn,
                                                                                    free_port) -> None:
    config, cfg = run_config(train={"steps": 100000, "checkpoint_every": 1})
    run_dir = Path(cfg.run_dir)
    first = spawn("learner", "--config", str(config), name="learner")
    wait_for(lambda: (run_dir / "checkpoints" / "latest.json").exists() or "learner listening" in
             first.log_path.read_text(), "the first learner serving", procs=[first])
    # Another learner on the same directory, on other ports: a --resume, as tried in the issue.
    line = _one_line(_learner("--resume", str(run_dir), "--bind", f"tcp://127.0.0.1:{free_port()}",
                              "--set", f"server.pub_bind='tcp://127.0.0.1:{free_port()}'"))
    assert line == (f"grpo-fleet learner: run directory {run_dir} is in use by another learner (pid {first.pid}); "
                    "stop it first, or use another run_dir"), line
    assert first.poll() is None


def test_a_taken_port_is_named_in_one_line(run_config, tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        for key, flags in (("server.bind", ["--bind", f"tcp://127.0.0.1:{port}"]),
                           ("server.pub_bind", ["--set", f"server.pub_bind='tcp://127.0.0.1:{port}'"])):
            config, _ = run_config(run_dir=str(tmp_path / key))
            line = _one_line(_learner("--config", str(config), *flags))
            assert line == (f"grpo-fleet learner: tcp://127.0.0.1:{port} is already in use (another learner, or "
                            "another program, listens there)"), (key, line)
        config, _ = run_config(run_dir=str(tmp_path / "metrics"))
        line = _one_line(_learner("--config", str(config), "--metrics-port", str(port)))
        assert line == (f"grpo-fleet learner: metrics port 127.0.0.1:{port} is already in use; choose another with "
                        "--metrics-port (0 disables it)"), line
