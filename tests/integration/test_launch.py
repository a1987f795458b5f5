"""`grpo-fleet launch`: a real learner and real actors, started through a local stand-in for ssh.

The stand-in ignores the host (except hostC, which it refuses like an unreachable
Mac, `stubborn`, which ignores SIGTERM, and `lingering`, whose session ends 2 s
after its command) and runs the command with `sh -c`,
as sshd runs it with the login shell.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from pydantic import ValidationError

from grpo_fleet.launch.fleet_file import ActorSpec, FleetConfig, LearnerSpec, actor_command, learner_connect, load_fleet, ssh_argv
from grpo_fleet.launch.launcher import run_fleet
from grpo_fleet.protocol.auth import add_actor, init_keys
from grpo_fleet.runtime.blas import child_env
from recipe_helpers import BREVITY_REWARD, recipe_config, save_gsm8k_like

REPO = Path(__file__).resolve().parents[2]
SHIPPED_FLEET = REPO / "deploy" / "fleet.toml"
SHIPPED_HOME = "/Users/me/grpo_fleet"  # where the shipped file puts the checkout on each actor Mac

FAKE_SSH = """#!/bin/sh
# Stands in for ssh: $1 is the host, $2 the command a remote shell would run.
case "$1" in
  hostC) echo "ssh: connect to host $1 port 22: Connection refused" >&2; exit 255 ;;
  stubborn) trap '' TERM; echo "ignoring SIGTERM"; sleep 600; exit 0 ;;
  lingering) sh -c "$2"; code=$?; sleep 2; exit $code ;;  # a session that closes after the learner has exited
esac
exec sh -c "$2"
"""
LAUNCHER = ("import sys; from grpo_fleet.launch.fleet_file import load_fleet; from grpo_fleet.launch.launcher import run_fleet; "
            "sys.exit(run_fleet(load_fleet(sys.argv[1])))")


def _toml(value: Any) -> str:
    # JSON strings, numbers and string arrays are valid TOML values.
    return json.dumps(value)


def _write_fleet(tmp_path: Path, config: Path, hosts: list[str], actor_args: list[str], **top: Any) -> Path:
    shim = tmp_path / "fake-ssh"
    shim.write_text(FAKE_SSH)
    shim.chmod(0o755)
    lines = [
        f"ssh = {_toml(shlex.quote(str(shim)) + ' {host} {command}')}",
        f"grpo_fleet = {_toml(shlex.quote(sys.executable) + ' -m grpo_fleet')}",
        *(f"{key} = {_toml(value)}" for key, value in top.items()),
        "[learner]",
        f"config = {_toml(str(config))}",
    ]
    for host in hosts:
        lines += ["[[actors]]", f"host = {_toml(host)}", f"args = {_toml(actor_args)}"]
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _prefixed(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


# --------------------------------------------------------------------------- the fleet file


def test_fleet_file_defaults_paths_and_commands(tmp_path: Path, run_config) -> None:
    config, cfg = run_config(server={"bind": "tcp://0.0.0.0:5555"})
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        '[learner]\nconfig = "run.json"\nkeys = "keys"\n'
        '[[actors]]\nhost = "mac1"\nworkdir = "~/my repo"\nkey = "a b.key_secret"\nlearner_key = "learner.key"\n'
        'args = ["--max-groups", "4"]\n'
        '[[actors]]\nhost = "mac1"\nid = "mac1-b"\n'
    )
    fleet = load_fleet(fleet_file)
    assert fleet.learner.config == str(config) and fleet.learner.keys == str(tmp_path / "keys")
    assert fleet.restart_backoff_max == 30 and fleet.grpo_fleet == "grpo-fleet"
    # A wildcard bind is dialled at this machine's name.
    connect = learner_connect(fleet)
    assert connect == f"tcp://{socket.gethostname()}:5555"

    command = actor_command(fleet, fleet.actors[0], connect)
    assert command.startswith("cd ~/'my repo' && grpo-fleet actor ")
    assert shlex.split(command.split(" && ", 1)[1]) == [
        "grpo-fleet", "actor", "--connect", connect, "--actor-id", "mac1", "--stdin-lifeline",
        "--key", "a b.key_secret", "--learner-key", "learner.key", "--max-groups", "4",
    ]
    # The remote command is ONE argument of the local ssh argv, and no host can be read as an option.
    assert ssh_argv(fleet.ssh, "mac1", command) == ["ssh", "-o", "BatchMode=yes", "--", "mac1", command]
    assert ssh_argv("ssh -p 2222 -- me@{host} {command}", "mac1", "x") == ["ssh", "-p", "2222", "--", "me@mac1", "x"]
    assert ssh_argv("/opt/my-ssh {host} {command}", "mac1", "x") == ["/opt/my-ssh", "mac1", "x"]  # not ssh: as written
    assert "--actor-id mac1-b" in actor_command(fleet, fleet.actors[1], connect)

    # The learner's run config is read up front: its errors show before anything starts.
    fleet_file.write_text('[learner]\nconfig = "missing.toml"\n[[actors]]\nhost = "a"\n')
    with pytest.raises(FileNotFoundError):
        load_fleet(fleet_file)


def test_a_leading_tilde_is_the_remote_home_and_args_pass_as_they_are(tmp_path: Path) -> None:
    """What deploy/fleet.toml says: ~/ in key, learner_key and workdir is the remote home; args are not expanded."""
    (tmp_path / "my repo").mkdir()
    actor = ActorSpec(host="mac1", workdir="~/my repo", key="~/k s/a.key_secret", learner_key="~/learner.key",
                      args=["--reward-module", "~/r.py"])
    fleet = FleetConfig(learner=LearnerSpec(config="run.toml"), actors=[actor], grpo_fleet="printf '%s\\n'")
    command = actor_command(fleet, actor, "tcp://h:5555")
    # As sshd runs it: the login shell, in the remote home.
    out = subprocess.run(["sh", "-c", command + " && pwd"], capture_output=True, text=True, check=True,
                         env={**os.environ, "HOME": str(tmp_path)}, cwd="/").stdout.splitlines()
    assert out[out.index("--key") + 1] == f"{tmp_path}/k s/a.key_secret"
    assert out[out.index("--learner-key") + 1] == f"{tmp_path}/learner.key"
    assert out[out.index("--reward-module") + 1] == "~/r.py"
    assert out[-1] == f"{tmp_path}/my repo"


@pytest.mark.parametrize("body, message", [
    ('[learner]\nconfig = "x"\n[[actors]]\nhost = "a"\nport = 1\n', "Extra inputs"),
    ('[learner]\nconfig = "x"\n[[actors]]\nhost = "a"\n[[actors]]\nhost = "a"\n', "unique"),
    ('[learner]\nconfig = "x"\n[[actors]]\nhost = "a"\nkey = "k"\n', "go together"),
    ('ssh = "ssh {host}"\n[learner]\nconfig = "x"\n[[actors]]\nhost = "a"\n', "{command}"),
    ('actors = []\n[learner]\nconfig = "x"\n', "at least 1"),
    ('[learner]\nconfig = "x"\n[[actors]]\nhost = "-oProxyCommand=touch /tmp/owned"\n', "starts with '-'"),
    ('[learner]\nconfig = "x"\n[[actors]]\nhost = "mac1 -oProxyCommand=x"\n', "one word"),
])
def test_fleet_file_errors(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(body)
    with pytest.raises(ValidationError, match=re.escape(message)):
        load_fleet(path)


# --------------------------------------------------------------------------- real runs


def test_launch_trains_to_the_end_with_a_failing_actor(tmp_path: Path, run_config, capsys) -> None:
    config, cfg = run_config(task={"num_train": 100, "num_eval": 8}, train={"steps": 20})
    run_dir = Path(cfg.run_dir)
    fleet = _write_fleet(tmp_path, config, ["hostA", "lingering", "hostC"],
                         ["--model-dir", str(run_dir), "--metrics-port", "0"], restart_backoff_max=4)
    stop = threading.Event()
    watchdog = threading.Timer(120, stop.set)  # a hung run fails the test instead of the session
    watchdog.start()
    try:
        code = run_fleet(load_fleet(fleet), stop_event=stop)
    finally:
        watchdog.cancel()
    out = capsys.readouterr().out
    assert not stop.is_set(), "the run did not finish in 120 s:\n" + out[-4000:]
    assert code == 0, out[-4000:]
    assert _metrics_lines(run_dir) == 20

    assert any("learner listening on" in line for line in _prefixed(out, "[learner] "))
    for host in ("hostA", "lingering"):
        assert any(f"actor {host} joined run" in line for line in _prefixed(out, f"[{host}] ")), host
        # Reported however its exit falls: `lingering`'s comes after the learner's, when no restart tick runs.
        assert f"[launch] {host} finished (exit code 0" in out, out[-4000:]
    assert "[hostC] ssh: connect to host hostC port 22: Connection refused" in out

    # The unreachable host is retried while the learner runs (the delays are checked in the
    # Ctrl-C test, whose run lasts as long as it needs), never after; the healthy actors left on Shutdown.
    assert "restarting hostC in 1s" in out
    after = out.split("[launch] learner exited with code 0", 1)[1]
    assert "[launch] started" not in after and "SIGKILL" not in out
    # The run's last line says how to take the checkpoint to a chat app (the tiny model: no GGUF).
    assert out.splitlines()[-1].startswith("[launch] next, fuse the adapters") and f"grpo-fleet export {run_dir}" in out


def test_failed_learner_stops_the_actors_and_sigkill_ends_a_stubborn_one(tmp_path: Path, run_config, capsys) -> None:
    # A wildcard bind without CURVE keys: the learner refuses to start (exit 2) once the actor is up.
    config, _ = run_config(server={"bind": "tcp://0.0.0.0:5555"})
    fleet = _write_fleet(tmp_path, config, ["stubborn"], [], stop_timeout=1)
    started = time.monotonic()
    code = run_fleet(load_fleet(fleet))
    out = capsys.readouterr().out
    assert code == 2, out
    assert "[learner] grpo-fleet learner: refusing" in out and "[stubborn] ignoring SIGTERM" in out
    assert "[launch] stubborn still running 1s after SIGTERM; SIGKILL" in out
    assert time.monotonic() - started < 30
    pid = int(re.search(r"started stubborn \(start 1, pid (\d+)\)", out).group(1))  # type: ignore[union-attr]
    assert _group_gone(pid, within=5.0), "the shell's `sleep` outlived SIGKILL"


def _group_gone(pgid: int, within: float) -> bool:
    # Orphans of a killed group are reaped by init a moment later; until then they still count.
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _pgrep(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _posix_ere(text: str) -> str:
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)


def _restart_delays(out: str, host: str) -> list[float]:
    return [float(d) for d in re.findall(rf"restarting {host} in ([\d.]+)s", out)]


def test_restarts_back_off_and_ctrl_c_stops_everything(tmp_path: Path, run_config) -> None:
    # No periodic checkpoints: the one found at the end must be the one written on the stop.
    config, cfg = run_config(task={"num_train": 100, "num_eval": 8}, train={"steps": 100000, "checkpoint_every": 100000})
    run_dir = Path(cfg.run_dir)
    # Every process of this fleet has tmp_path on its command line: that is how we find leftovers.
    # A short request timeout: an actor still holding rollouts when the learner is gone gives up soon.
    fleet = _write_fleet(tmp_path, config, ["hostA", "hostB", "hostC"],
                         ["--model-dir", str(run_dir), "--metrics-port", "0", "--request-timeout", "5"],
                         restart_backoff_max=2)
    ours = _posix_ere(str(tmp_path))
    lines: list[str] = []
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(fleet)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=child_env(), start_new_session=True,
    )
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    code: Optional[int] = None
    try:
        deadline = time.monotonic() + 90

        def prefixes() -> set[str]:
            return {line.split(" ", 1)[0] for line in list(lines)}

        # Both healthy actors' output must come through, prefixed; one may start later than
        # the other (on a loaded machine the first can train the 3 steps alone).
        while (_metrics_lines(run_dir) < 3 or len(_restart_delays("".join(lines), "hostC")) < 3
               or not {"[hostA]", "[hostB]"} <= prefixes()):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.2)
        # Doubling from 1 s, capped at restart_backoff_max.
        assert _restart_delays("".join(lines), "hostC")[:3] == [1.0, 2.0, 2.0]
        assert len(_pgrep(ours)) >= 4  # launcher, learner, two actors (plus their shells)

        launcher.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal delivers
        code = launcher.wait(timeout=40)
        gone_by = time.monotonic() + 10
        while _pgrep(ours) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert _pgrep(ours) == [], "processes left behind"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in _pgrep(ours):  # only processes with this test's tmp_path in their command line
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=5)
    out = "".join(lines)
    assert code == 0, out[-4000:]
    assert "[launch] stopping" in out and "SIGKILL" not in out
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] >= 3 and latest["step"] == _metrics_lines(run_dir), "the stop checkpoint holds the last step"


def test_the_learner_gets_the_time_its_step_and_checkpoint_need_past_stop_timeout(
        tmp_path: Path, run_config, capsys) -> None:
    """stop_timeout is a floor: a learner's last step plus its checkpoint outlasted it and was SIGKILLed, losing the
    steps since its last checkpoint. Here only the stop writes one, and stop_timeout is far too short for it."""
    config, cfg = run_config(task={"num_train": 100, "num_eval": 8}, train={"steps": 100000, "checkpoint_every": 100000})
    run_dir = Path(cfg.run_dir)
    fleet = _write_fleet(tmp_path, config, ["hostA"], ["--model-dir", str(run_dir), "--metrics-port", "0"],
                         stop_timeout=0.1)
    stop = threading.Event()
    stopper = threading.Thread(target=lambda: (_wait_lines(run_dir, 3, stop, 120), stop.set()), daemon=True)
    stopper.start()
    assert run_fleet(load_fleet(fleet), stop_event=stop) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[launch\] waiting up to \d+s for the learner's last step and checkpoint \(stop_timeout, more "
                     r"than its step takes up to [\d.]+s", out) is None, "0.1 s is less than any learner needs"
    assert re.search(r"\[launch\] waiting up to (\d+)s for the learner's last step and checkpoint \(its step takes "
                     r"up to [\d.]+s and a checkpoint [\d.]+s \(not measured yet, taken as a step\)", out), out[-4000:]
    assert "learner still running" not in out, out[-4000:]
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] >= 3 and latest["step"] == _metrics_lines(run_dir), "the stop checkpoint holds the last step"


def test_a_refused_actor_is_stopped_with_its_reason_and_launch_resume_continues_the_run(
        tmp_path: Path, run_config, capsys) -> None:
    config, cfg = run_config(task={"num_train": 100, "num_eval": 8}, train={"steps": 12, "checkpoint_every": 100000})
    run_dir = Path(cfg.run_dir)
    fleet = _write_fleet(tmp_path, config, ["hostA"], ["--model-dir", str(run_dir), "--metrics-port", "0"])
    # No --model-dir: the learner's model lies outside what this actor may load, so it refuses on every start (exit 2).
    with fleet.open("a") as handle:
        handle.write('[[actors]]\nhost = "refuser"\nargs = ["--metrics-port", "0"]\n')
    stop = threading.Event()
    stopper = threading.Thread(target=lambda: (_wait_lines(run_dir, 4, stop, 120), stop.set()), daemon=True)
    stopper.start()
    assert run_fleet(load_fleet(fleet), stop_event=stop) == 0
    first = capsys.readouterr().out
    assert 4 <= _metrics_lines(run_dir) < 12, first[-4000:]
    assert re.search(r"\[launch\] refuser refused to run \(exit code 2, permanent\); not restarting it: "
                     r"grpo-fleet actor: refusing to run: .*model", first), first[-4000:]
    assert "started refuser (start 1" in first and "started refuser (start 2" not in first
    assert "restarting refuser" not in first
    recorded = json.loads((run_dir / "launch.json").read_text())["refused"]
    assert [(r["actor"], r["exit_code"]) for r in recorded] == [("refuser", 2)]
    assert "refusing to run" in recorded[0]["reason"]

    stop = threading.Event()
    watchdog = threading.Timer(150, stop.set)
    watchdog.start()
    try:
        code = run_fleet(load_fleet(fleet), stop_event=stop, resume=str(run_dir))
    finally:
        watchdog.cancel()
    second = capsys.readouterr().out
    assert not stop.is_set() and code == 0, second[-4000:]
    assert "--resume" in second and any("resumed run" in line for line in _prefixed(second, "[learner] "))
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "event" not in json.loads(line)] == list(range(1, 13)), "the resumed run continued to its target"


def _wait_lines(run_dir: Path, count: int, stop: threading.Event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _metrics_lines(run_dir) < count and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.2)


def _shipped_fleet_here(tmp_path: Path, learner_config: Path, rewards_file: Path) -> Path:
    """deploy/fleet.toml as shipped, with only what differs on this machine replaced.

    The actor Macs' checkout (SHIPPED_HOME) becomes a folder here holding what the
    file says each Mac has: its key, the learner's public key and its copy of the
    recipe's reward file (`rewards_file`, as the learner has it). The ssh template becomes the local stand-in, and the
    learner runs the recipe on the tiny model. Actor flags stay as shipped.
    """
    home = tmp_path / "mac-home"
    (home / "configs").mkdir(parents=True)
    (home / "configs" / "gsm8k_rewards.py").write_bytes(rewards_file.read_bytes())
    keys = tmp_path / "keys"  # the shipped file's learner.keys is "../keys", next to its own folder
    init_keys(keys)
    (home / "learner.key").write_bytes((keys / "learner.key").read_bytes())
    text = SHIPPED_FLEET.read_text()
    for name in re.findall(r'key = "' + SHIPPED_HOME + r'/([\w-]+)\.key_secret"', text):
        (home / f"{name}.key_secret").write_bytes(add_actor(keys, name).read_bytes())
    shim = tmp_path / "fake-ssh"
    shim.write_text(FAKE_SSH)
    shim.chmod(0o755)
    text = text.replace(SHIPPED_HOME, str(home))
    text = re.sub(r'(?m)^ssh = .*$', lambda _: f"ssh = {_toml(shlex.quote(str(shim)) + ' {host} {command}')}\n"
                  f"grpo_fleet = {_toml(shlex.quote(sys.executable) + ' -m grpo_fleet')}", text, count=1)
    text = re.sub(r'(?m)^config = .*$', lambda _: f"config = {_toml(str(learner_config))}", text, count=1)
    path = tmp_path / "deploy" / "fleet.toml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_the_shipped_fleet_file_launches_and_every_actor_joins(tmp_path: Path, free_port, capsys) -> None:
    rewards = {"r1_format": 0.2, "r1_accuracy": 1.0, "concise_reasoning": 0.1, "reverse_positions": 0.1, "brevity": 0.1}
    rewards_file = tmp_path / "gsm8k_rewards.py"  # the recipe's, and a reward the tiny model's groups differ by
    rewards_file.write_text((REPO / "configs" / "gsm8k_rewards.py").read_text() + BREVITY_REWARD)
    config, cfg = recipe_config(tmp_path, free_port, save_gsm8k_like(tmp_path / "gsm8k"), rewards_file, rewards)
    fleet = load_fleet(_shipped_fleet_here(tmp_path, config, rewards_file))
    shipped = load_fleet(SHIPPED_FLEET)
    assert [a.name for a in fleet.actors] == [a.name for a in shipped.actors] and fleet.learner.keys
    # Two actors share this machine: free metrics ports, and the tiny model from the learner's run dir.
    extra = ["--metrics-port", "0", "--model-dir", cfg["run_dir"]]
    fleet = fleet.model_copy(update={"actors": [a.model_copy(update={"args": a.args + extra}) for a in fleet.actors]})
    stop = threading.Event()
    watchdog = threading.Timer(240, stop.set)
    watchdog.start()
    try:
        code = run_fleet(fleet, stop_event=stop)
    finally:
        watchdog.cancel()
    out = capsys.readouterr().out
    assert not stop.is_set(), "the run did not finish in 240 s:\n" + out[-4000:]
    assert code == 0, out[-4000:]
    for actor in fleet.actors:
        assert any(f"actor {actor.name} joined run" in line for line in _prefixed(out, f"[{actor.name}] ")), out[-4000:]
    assert "refused to run" not in out and "; restarting" not in out, out[-4000:]
    # Each actor left when the learner said Shutdown, and the launcher let it be.
    assert all(f"[launch] {a.name} finished (exit code 0" in out for a in fleet.actors), out[-4000:]
    assert _metrics_lines(Path(cfg["run_dir"])) >= 4
