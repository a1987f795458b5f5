"""`grpo-fleet launch` over a real sshd on 127.0.0.1: stopping the launcher stops the remote actor for real.

Without a terminal, a signal to the local ssh client never reached the remote
actor: it kept running (and reconnecting) after the launcher had stopped. The
test starts its own sshd on a free port, with its own host key and an authorized
key in a temporary directory, as whoever runs the tests (`make test-deps`
installs Debian's openssh-server). Actors' processes are found by this test's
tmp_path in their command line: sshd starts them, not the launcher.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from grpo_fleet.runtime.blas import child_env
from helpers import free_port

LAUNCHER = ("import sys; from grpo_fleet.launch.fleet_file import load_fleet; from grpo_fleet.launch.launcher import run_fleet; "
            "sys.exit(run_fleet(load_fleet(sys.argv[1])))")
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd, started as root, wants it (systemd makes it; we may have none)


def _sshd_binary() -> str:
    found = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)),
                                         None)
    if found is None:
        pytest.skip("no sshd here: `make test-deps` installs Debian's openssh-server")
    if os.geteuid() == 0 and sys.platform.startswith("linux") and not PRIVSEP_DIR.is_dir():
        try:
            PRIVSEP_DIR.mkdir(mode=0o755)
        except OSError as exc:
            pytest.skip(f"sshd as root needs {PRIVSEP_DIR}, which cannot be made: {exc}")
    return found


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[str]:
    """A private sshd on 127.0.0.1; yields the ssh template that logs into it (no password, no known_hosts)."""
    binary = _sshd_binary()
    home = tmp_path / "sshd"
    home.mkdir()
    _keygen(home / "host_key")
    _keygen(home / "client_key")
    authorized = home / "authorized_keys"
    authorized.write_text((home / "client_key.pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    (home / "sshd_config").write_text("\n".join([
        f"ListenAddress 127.0.0.1:{port}", f"HostKey {home / 'host_key'}", f"AuthorizedKeysFile {authorized}",
        f"PidFile {home / 'sshd.pid'}", "StrictModes no", "UsePAM no", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "LogLevel VERBOSE", ""]))
    log = open(home / "sshd.log", "w")
    daemon = subprocess.Popen([binary, "-D", "-e", "-f", str(home / "sshd_config")], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_listening(port, daemon, home / "sshd.log")
        yield (f"ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile={home / 'known'} "
               f"-o IdentitiesOnly=yes -i {home / 'client_key'} -p {port} {{host}} {{command}}")
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
        log.close()


def _wait_listening(port: int, daemon: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            pytest.skip(f"sshd would not start here: {log.read_text()[-500:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"sshd did not listen on {port}: {log.read_text()[-500:]}")


def _fleet(tmp_path: Path, ssh: str, config: Path, run_dir: Path) -> Path:
    env = child_env({})  # sshd gives the remote command a bare environment: the BLAS settings go on its line
    prefix = " ".join(["env", *(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())),
                       shlex.quote(sys.executable), "-m", "grpo_fleet"])
    args = ["--model-dir", str(run_dir), "--metrics-port", "0", "--request-timeout", "5"]
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join([
        f"ssh = {_toml(ssh)}", f"grpo_fleet = {_toml(prefix)}", "[learner]", f"config = {_toml(str(config))}",
        "[[actors]]", f"host = {_toml(getpass.getuser() + '@127.0.0.1')}", 'id = "remote"', f"args = {_toml(args)}", ""]))
    return path


def _toml(value: object) -> str:
    import json
    return json.dumps(value)


def _remote_actors(tmp_path: Path) -> list[int]:
    """This test's actor processes (started by sshd: the launcher's pids do not reach them)."""
    found = subprocess.run(["pgrep", "-f", "--", f"--actor-id remote .*{tmp_path}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _gone(tmp_path: Path, within: float) -> bool:
    deadline = time.monotonic() + within
    while _remote_actors(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _remote_actors(tmp_path)


class _Launch:
    """`grpo-fleet launch` in a process of its own, its output collected."""

    def __init__(self, fleet: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(fleet)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=child_env(), start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.out:
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {text!r}:\n{self.out[-4000:]}"
            time.sleep(0.2)


def _kill_leftovers(tmp_path: Path) -> None:
    found = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    for pid in [int(p) for p in found.stdout.split()]:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "launcher killed"])
def test_stopping_the_launcher_stops_the_remote_actor(tmp_path: Path, sshd: str, run_config, how: str) -> None:
    config, cfg = run_config(train={"steps": 100000})
    launch: Optional[_Launch] = None
    try:
        launch = _Launch(_fleet(tmp_path, sshd, config, Path(cfg.run_dir)))
        launch.wait_for("[remote] ")
        launch.wait_for("actor remote joined run")
        assert _remote_actors(tmp_path), launch.out[-3000:]
        if how == "ctrl-c":
            launch.proc.send_signal(signal.SIGINT)
            assert launch.proc.wait(timeout=60) == 0, launch.out[-4000:]
        else:  # SIGKILL: nothing of the launcher runs; the kernel closes its end of each actor's stdin
            launch.proc.kill()
            launch.proc.wait()
        assert _gone(tmp_path, within=30), f"the remote actor outlived the launcher ({how}):\n{launch.out[-4000:]}"
        if how == "ctrl-c":  # it stopped in order, and said so through ssh
            launch.reader.join(timeout=10)
            assert "stdin closed" in launch.out and "actor remote stopping: signal" in launch.out, launch.out[-4000:]
            assert "SIGKILL" not in launch.out, launch.out[-4000:]
    finally:
        if launch is not None and launch.proc.poll() is None:
            os.killpg(launch.proc.pid, signal.SIGKILL)
        _kill_leftovers(tmp_path)  # a learner orphaned by the SIGKILL, or whatever a failure left
