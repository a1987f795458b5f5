"""A learner and its actors as child processes of this one: start them, notice one dying, stop them all.

The demo and the end-to-end benchmark run a whole fleet on this machine. Each
child runs in its own session, so a Ctrl-C at the terminal reaches only this
process, which then stops the children itself; each writes its own log, whose
last lines are what the console shows when a child ends the run early.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator, Optional, Sequence

from grpo_fleet.config import RunConfig
from grpo_fleet.protocol.endpoints import free_port
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.runtime.blas import child_env

# Enough for a refusal message or the end of a traceback (the exception and its last frames).
TAIL_LINES = 12
TAIL_BYTES = 16 * 1024
TAIL_LINE_CHARS = 400


@dataclass(frozen=True)
class Child:
    """One process of the fleet, by the name the console shows it under."""

    name: str  # "learner", "actor-0", ...
    proc: subprocess.Popen
    log_path: Path


@dataclass(frozen=True)
class Fleet:
    learner: Child
    actors: list[Child]
    actor_ports: list[int]

    @property
    def children(self) -> list[Child]:
        return [self.learner, *self.actors]


@dataclass(frozen=True)
class FleetStop:
    """Why the fleet stopped before its learner finished: which child, its exit status, its log's last lines."""

    name: str
    returncode: int
    log_path: Path
    log_tail: tuple[str, ...]

    def describe(self) -> str:
        lines = [f"{self.name} {exit_status(self.returncode)} before training finished; "
                 f"the last lines of {self.log_path}:"]
        lines += [f"  | {line}" for line in self.log_tail] or ["  (the log is empty)"]
        return "\n".join(lines)


def exit_status(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def log_tail(path: Path, lines: int = TAIL_LINES) -> tuple[str, ...]:
    """The last non-blank lines of a log, each cut and escaped to printable ASCII: the log holds text
    from the learner (a model path, a peer's message) that must not drive the operator's terminal."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return (f"(cannot read the log: {shown(exc)})",)
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return tuple(shown(line, limit=TAIL_LINE_CHARS) for line in kept)


def early_stop(fleet: Fleet, training_finished: Callable[[], bool]) -> Optional[FleetStop]:
    """The child whose exit ends the run early, or None while the run can go on.

    A learner that fails ends it. An actor ends it by exiting at all before the
    last step: the actors are alike, so what stopped one (a refused model, a
    crash) is the others' fate too, and a fleet waiting on actors that are gone
    waits forever. Exit 0 after the last step is the learner's goodbye. The actor
    is polled before `training_finished` is asked, because the learner writes the
    last step's record before it says goodbye.
    """
    code = fleet.learner.proc.poll()
    if code is not None and code != 0:
        return stopped(fleet.learner, code)
    for actor in fleet.actors:
        code = actor.proc.poll()
        if code is not None and (code != 0 or not training_finished()):
            return stopped(actor, code)
    return None


def stopped(child: Child, returncode: int) -> FleetStop:
    return FleetStop(child.name, returncode, child.log_path, log_tail(child.log_path))


def fleet_env() -> dict:
    """Environment for processes that share this machine: OpenBLAS, one BLAS thread each.

    Learner and actors already keep every core busy; BLAS threads on top of that
    oversubscribe the CPU (measured: 500 demo steps took 49 s with OpenBLAS's
    default threads and 37 s with one per process on 2 cores).
    """
    env = child_env()
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _spawn(name: str, args: list[str], log_path: Path, core: Optional[int] = None) -> Child:
    with open(log_path, "w") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_fleet", *args], stdout=log, stderr=subprocess.STDOUT,
            env=fleet_env(), start_new_session=True,
        )
    if core is not None:
        pin(proc.pid, core)
    return Child(name, proc, log_path)


def pin(pid: int, core: int) -> None:
    """Keep process `pid` on one CPU core (Linux), so that a core stands for one machine of a real fleet.

    Popen returns once the child has exec'd Python, before it starts any thread
    (BLAS and MLX pools come with their imports, much later), and threads and
    exec (the CLI's OpenBLAS re-exec) inherit the mask: the whole child stays on `core`.
    """
    os.sched_setaffinity(pid, {core})


def actor_model_dirs(cfg: RunConfig) -> list[str]:
    """Where this fleet's actors may load the learner's model from: the run directory (the tiny model
    is built there) and the directory `model.path` names, if it is one (a hub id needs no permission)."""
    dirs = [str(Path(cfg.run_dir).resolve())]
    model = Path(cfg.model.path).expanduser()
    if model.is_dir():
        dirs.append(str(model.resolve()))
    elif model.is_file():  # a GGUF: each actor imports it from where it lies
        dirs.append(str(model.resolve().parent))
    return dirs


def env_dirs(cfg: RunConfig) -> list[str]:
    """The folder of task.env's file, when it is a file: the local actors import the learner's own copy, as they
    read its reward module (a module name is installed, and allowed as it is)."""
    if not cfg.task.env:
        return []
    from grpo_fleet.tasks.env_module import canonical_env
    from grpo_fleet.tasks.reward_module import is_module_name

    module, _ = canonical_env(cfg.task.env)
    return [] if is_module_name(module) else [str(Path(module).parent)]


def actor_args(cfg: RunConfig, index: int, metrics_port: int) -> list[str]:
    """`grpo-fleet actor` arguments for this fleet's actor `index`: allowed what its learner uses
    from this machine, the model directory, the reward module and the environment (the same files here)."""
    args = ["actor", "--connect", cfg.server.bind, "--actor-id", f"demo-actor-{index}",
            "--metrics-port", str(metrics_port), "--max-groups", str(cfg.server.max_groups_per_lease)]
    args += [arg for path in actor_model_dirs(cfg) + env_dirs(cfg) for arg in ("--model-dir", path)]
    if cfg.task.reward_module:
        args += ["--reward-module", cfg.task.reward_module]
    return args


def start_fleet(cfg: RunConfig, config_path: Path, actors: int, cores: Optional[Sequence[int]] = None) -> Fleet:
    """Start the learner and `actors` actor processes, each logging to RUN_DIR/NAME.log.

    `cores` pins each child to one core, the learner first and then each actor (Linux only): on one
    many-core machine, a core per process measures the fleet as the separate machines it stands for.
    None leaves every child to the scheduler.
    """
    run_dir = Path(cfg.run_dir)
    pins = core_of_each(cores, actors)  # checked before anything starts
    learner = _spawn("learner", ["learner", "--config", str(config_path)], run_dir / "learner.log", pins[0])
    ports = [free_port() for _ in range(actors)]
    fleet = [_spawn(f"actor-{i}", actor_args(cfg, i, port), run_dir / f"actor-{i}.log", pins[i + 1])
             for i, port in enumerate(ports)]
    return Fleet(learner, fleet, ports)


def core_of_each(cores: Optional[Sequence[int]], actors: int) -> list[Optional[int]]:
    """The core of the learner, then of each actor (None: not pinned)."""
    if cores is None:
        return [None] * (actors + 1)
    if len(cores) != actors + 1:
        raise ValueError(f"cores names {len(cores)} cores for {actors + 1} processes (the learner and each actor)")
    return list(cores)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal the child's whole process group (its own session: only it and what it started)."""
    if proc.poll() is None:  # not yet reaped, so its pid (the group's id) is still ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)


def stop(fleet: Fleet, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL whatever is left; only our own processes."""
    for child in fleet.children:
        _signal_group(child.proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in fleet.children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()


def _leave(signum: int, _frame: Optional[FrameType]) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def running(cfg: RunConfig, config_path: Path, actors: int, cores: Optional[Sequence[int]] = None) -> Iterator[Fleet]:
    """A started fleet for the length of a block, stopped however the block ends: an error, Ctrl-C,
    or SIGTERM (from `timeout` or a service manager), which unwinds here like Ctrl-C does.
    `cores`: see start_fleet."""
    previous = signal.signal(signal.SIGTERM, _leave)
    try:
        fleet = start_fleet(cfg, config_path, actors, cores)
        try:
            yield fleet
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stopping short
            stop(fleet)
    finally:
        signal.signal(signal.SIGTERM, previous)
