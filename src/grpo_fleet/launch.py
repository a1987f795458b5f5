"""`grpo-fleet launch FLEET.toml`: the learner on this machine, every actor over ssh, kept alive.

The fleet file names the learner's run config and one `[[actors]]` entry per
actor. The launcher starts the learner here, then each actor through an ssh
command template, copies every process's output to its own stdout with a
`[learner]` / `[ACTOR]` prefix, restarts actors that exit while the learner runs
(exponential backoff) unless their exit is permanent (exit_codes.py: a refusal
fails the same way on every start; it is stopped with its reason, recorded in
RUN_DIR/launch.json for `grpo-fleet status --run-dir`), and stops everything
cleanly on Ctrl-C or SIGTERM.

Example::

    ssh = "ssh -o BatchMode=yes {host} {command}"
    grpo_fleet = "~/grpo-fleet/.venv/bin/grpo-fleet"

    [learner]
    config = "configs/qwen2.5-0.5b-gsm8k-mac.toml"
    keys = "keys"

    [[actors]]
    host = "studio-1.local"
    workdir = "grpo-fleet"
    key = "studio-1.key_secret"
    learner_key = "learner.key"
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo_fleet.blas import child_env
from grpo_fleet.config import RunConfig, load_run_config, toml_string
from grpo_fleet.exit_codes import NOT_FOUND
from grpo_fleet.launch_policy import (
    FIRST_BACKOFF_SECONDS,
    Refusal,
    after_exit,
    read_refusals,
    record_refusals,
)
from grpo_fleet.protocol.endpoints import dialable
from grpo_fleet.tasks.reward_module import is_module_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_SSH = "ssh -o BatchMode=yes {host} {command}"
# After the learner's own exit it has already waited (up to 10 s) for every actor to hear
# Shutdown, so actors still running by then are exiting or never will: wait only briefly.
ACTOR_GRACE_SECONDS = 5.0
# On a stop, actors get SIGTERM first and this long to deliver what they hold while the learner still listens.
ACTOR_DRAIN_SECONDS = 5.0
POLL_SECONDS = 0.2


# --------------------------------------------------------------------------- fleet file


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LearnerSpec(_Section):
    """The learner, started on this machine as `python -m grpo_fleet learner`."""

    config: str = Field(description="Run config file (TOML or JSON); relative to the fleet file's directory.")
    keys: Optional[str] = Field(None, description="CURVE keys directory (`--keys`); relative to the fleet file's directory.")
    args: list[str] = Field(default_factory=list, description="Extra learner flags, e.g. ['--metrics-host', '0.0.0.0'].")
    connect: Optional[str] = Field(
        None,
        description="Address the actors dial. Default: the config's server.bind (after --bind/--set in args), "
        "with a wildcard host replaced by this machine's hostname.",
    )


class ActorSpec(_Section):
    """One actor process on one host, started through the ssh template."""

    host: str = Field(min_length=1, description="Host name given to the ssh template's {host}.")
    id: Optional[str] = Field(None, description="--actor-id and the output prefix; default: host. Unique in the fleet.")
    key: Optional[str] = Field(None, description="Path on that host to this actor's CURVE secret key (NAME.key_secret).")
    learner_key: Optional[str] = Field(None, description="Path on that host to the learner's public key (learner.key).")
    workdir: Optional[str] = Field(None, description="Directory on that host to cd into first (relative to the remote home).")
    args: list[str] = Field(default_factory=list, description="Extra actor flags, e.g. ['--model-dir', 'models'].")

    @model_validator(mode="after")
    def _keys_in_pairs(self) -> "ActorSpec":
        # The actor refuses to run with only one of them; say so here, not after a restart loop.
        if (self.key is None) != (self.learner_key is None):
            raise ValueError(f"actor {self.name}: key and learner_key go together")
        return self

    @property
    def name(self) -> str:
        """The actor id: what it is called in the learner's logs and in our output."""
        return self.id or self.host


class FleetConfig(_Section):
    """A whole fleet: how to reach the hosts, the learner, the actors."""

    ssh: str = Field(
        DEFAULT_SSH,
        description="Command template that runs {command} (one shell-quoted argument) on {host}.",
    )
    grpo_fleet: str = Field(
        "grpo-fleet", min_length=1,
        description="The grpo-fleet command on the remote hosts, inserted unquoted (e.g. '.venv/bin/grpo-fleet').",
    )
    learner: LearnerSpec = Field(description="The learner run on this machine.")
    actors: list[ActorSpec] = Field(min_length=1, description="One entry per actor process.")
    restart_backoff_max: float = Field(
        30.0, ge=FIRST_BACKOFF_SECONDS, description="Longest wait, in seconds, before restarting an actor."
    )
    stop_timeout: float = Field(
        30.0, gt=0, description="Seconds processes get after SIGTERM (the learner checkpoints) before SIGKILL."
    )

    @field_validator("ssh")
    @classmethod
    def _template_works(cls, template: str) -> str:
        if "{command}" not in template:
            raise ValueError("the ssh template needs a {command} placeholder")
        try:
            ssh_argv(template, "host", "true")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"bad ssh template {template!r}: only {{host}} and {{command}} may appear ({exc})") from exc
        return template

    @model_validator(mode="after")
    def _unique_ids(self) -> "FleetConfig":
        # The actor id is its ZeroMQ identity: two live actors with one id would take over each other's connection.
        names = [actor.name for actor in self.actors]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"actor ids must be unique; set `id` for the repeated ones: {duplicates}")
        return self


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate a fleet file; local paths in it are taken relative to its directory.

    The learner's run config is loaded too, so its errors show before anything starts.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        cfg = FleetConfig.model_validate(tomllib.load(handle))
    base = path.resolve().parent
    learner = cfg.learner
    resolved = learner.model_copy(update={
        "config": str(base / Path(learner.config).expanduser()),
        "keys": str(base / Path(learner.keys).expanduser()) if learner.keys else None,
    })
    _learner_bind(resolved)
    return cfg.model_copy(update={"learner": resolved})


def actor_gaps(cfg: FleetConfig, run: RunConfig) -> list[str]:
    """What an actor's entry lacks for this run, one line per actor and gap: each is a refusal waiting to happen.

    The run's reward file (task.reward_module) is run from each actor's own copy,
    which it finds by --reward-module, or, for a file, by the same relative path in
    its workdir (or a --model-dir). A learner with CURVE keys admits only actors with keys.
    """
    gaps = []
    module = run.task.reward_module
    for actor in cfg.actors:
        found_by_path = module is not None and not is_module_name(module) and (
            (actor.workdir is not None and not Path(module).is_absolute()) or "--model-dir" in actor.args)
        if module is not None and "--reward-module" not in actor.args and not found_by_path:
            gaps.append(f"actor {actor.name}: the run's rewards are in {module!r} (task.reward_module); add "
                        f'"--reward-module", "PATH of its copy on {actor.host}" to its args, or it refuses the run')
        if (cfg.learner.keys or run.security.keys_dir) and actor.key is None:
            gaps.append(f"actor {actor.name}: the learner admits only actors with CURVE keys; set its key and learner_key")
    return gaps


# --------------------------------------------------------------------------- commands


def ssh_argv(template: str, host: str, command: str) -> list[str]:
    """The local argv that runs `command` on `host`: the command travels as one quoted word."""
    return shlex.split(template.format(host=shlex.quote(host), command=shlex.quote(command)))


def _remote_path(path: str) -> str:
    """Quote a path for the remote shell but keep a leading ~ expandable there."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return "~/" + shlex.quote(rest) if rest else "~"
    return shlex.quote(path)


def actor_command(cfg: FleetConfig, actor: ActorSpec, connect: str) -> str:
    """The shell command an actor's host runs: `[cd WORKDIR &&] GRPO_FLEET actor ...`."""
    words = ["actor", "--connect", shlex.quote(connect), "--actor-id", shlex.quote(actor.name)]
    if actor.key and actor.learner_key:
        words += ["--key", _remote_path(actor.key), "--learner-key", _remote_path(actor.learner_key)]
    words += [shlex.quote(arg) for arg in actor.args]
    # grpo_fleet stays unquoted: it may be several words ("~/venv/bin/python -m grpo_fleet").
    command = " ".join([cfg.grpo_fleet, *words])
    return f"cd {_remote_path(actor.workdir)} && {command}" if actor.workdir else command


def learner_argv(cfg: FleetConfig, resume: Optional[str] = None) -> list[str]:
    """The local learner command; this interpreter, so it runs the same installation.

    `resume` is a run directory to continue from its latest checkpoint (the learner's `--resume`).
    """
    start = ["--resume", resume] if resume is not None else ["--config", cfg.learner.config]
    argv = [sys.executable, "-m", "grpo_fleet", "learner", *start]
    if cfg.learner.keys:
        argv += ["--keys", cfg.learner.keys]
    return argv + list(cfg.learner.args)


def learner_connect(cfg: FleetConfig, resume: Optional[str] = None) -> str:
    """Where actors dial: `learner.connect`, or the learner's bind with a wildcard made reachable."""
    if cfg.learner.connect:
        return cfg.learner.connect
    return dialable(learner_run_config(cfg.learner, resume).server.bind, socket.gethostname())


def learner_run_config(learner: LearnerSpec, resume: Optional[str] = None) -> RunConfig:
    """The run config the learner will use: its file (RUN_DIR/config.json when resuming) plus its flags."""
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags.add_argument("--bind")
    flags.add_argument("--run-dir")
    flags.add_argument("--set", action="append", default=[])
    known, _ = flags.parse_known_args(learner.args)
    overrides = list(known.set) + ([f"server.bind={toml_string(known.bind)}"] if known.bind else [])
    run_dir = resume or known.run_dir
    if run_dir:
        overrides.append(f"run_dir={toml_string(run_dir)}")
    return load_run_config(Path(resume) / "config.json" if resume else learner.config, overrides)


def _learner_bind(learner: LearnerSpec) -> str:
    return learner_run_config(learner).server.bind


# --------------------------------------------------------------------------- processes


class _Printer:
    """Our stdout, shared by the reader threads; one lock so lines never interleave."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream: Optional[IO[str]] = stream
        self.lock = threading.RLock()  # re-entered by _Child, which prints while holding it

    def line(self, prefix: str, text: str) -> None:
        with self.lock:
            if self.stream is None:
                return
            body = text.rstrip("\r\n")  # CRLF too: `ssh -tt` output comes through a remote tty
            try:
                self.stream.write(f"{prefix}{body}\n")
                self.stream.flush()  # a pipe or a log file should see each line as it happens
            except (OSError, ValueError):
                # Our stdout is gone (`| head`, closed terminal): keep draining the children's
                # pipes regardless, or a child blocks on a full pipe and the run stalls.
                self.stream = None

    def say(self, text: str) -> None:
        self.line("[launch] ", text)


def _copy_lines(pipe: IO[bytes], prefix: str, printer: _Printer, last: list[str]) -> None:
    """Reader thread: child output to ours, line by line, until every writer has closed the pipe.

    The last non-blank line is kept in `last`: a refused actor's reason is what it printed last.
    """
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", errors="replace")
            printer.line(prefix, text)
            if text.strip():
                last[:] = [text.strip()]


class _Child:
    """One process we started in its own session (so its whole group can be signalled) and its reader."""

    def __init__(self, name: str, argv: list[str], printer: _Printer, env: Optional[dict] = None, note: str = "") -> None:
        self.name = name
        self.started = time.monotonic()
        self._last: list[str] = []  # written by the reader thread
        # Holding the output lock until our "started" line is out keeps it ahead of the child's first line.
        with printer.lock:
            # stdin from /dev/null: ssh must not eat our terminal's input; a new session: Ctrl-C on
            # our terminal reaches only us, and we decide who is stopped how.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
            assert self.proc.stdout is not None
            self.reader = threading.Thread(
                target=_copy_lines, args=(self.proc.stdout, f"[{name}] ", printer, self._last), name=f"launch-{name}",
                daemon=True,
            )
            self.reader.start()
            details = ", ".join(filter(None, [note, f"pid {self.proc.pid}"]))
            printer.say(f"started {name} ({details}): {shlex.join(argv)}")

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        # Only while the leader is unreaped: until then its pid (our group id) cannot be reused by a stranger.
        if self.running():
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        self.proc.wait()
        # Wait for the last lines, boundedly: a leftover grandchild (an ssh ControlMaster) may hold the pipe open.
        self.reader.join(timeout=2.0)

    @property
    def last_line(self) -> str:
        """What the process printed last (reap first, so the reader has seen it all)."""
        return self._last[0] if self._last else ""


def _wait_all(children: list[_Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(child.running() for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)


def _terminate(learner: _Child, actors: list[_Child], timeout: float, printer: _Printer) -> None:
    """SIGTERM actors, then the learner; SIGKILL whatever outlives the learner's SIGTERM by `timeout`."""
    for actor in actors:
        actor.signal(signal.SIGTERM)
    # Actors first: one holding finished rollouts delivers them while the learner still takes them.
    _wait_all(actors, min(ACTOR_DRAIN_SECONDS, timeout))
    learner.signal(signal.SIGTERM)  # it finishes the step in hand and writes a checkpoint
    everyone = [learner, *actors]
    _wait_all(everyone, timeout)  # the full bound for the learner: a big model's checkpoint takes a while
    for child in everyone:
        if child.running():
            printer.say(f"{child.name} still running {timeout:g}s after SIGTERM; SIGKILL")
            child.signal(signal.SIGKILL)
    for child in everyone:
        child.reap()


class _ActorSlot:
    """One [[actors]] entry: its command line, its current process and its restart schedule."""

    def __init__(self, spec: ActorSpec, argv: list[str]) -> None:
        self.spec = spec
        self.argv = argv
        self.child: Optional[_Child] = None
        self.backoff = FIRST_BACKOFF_SECONDS
        self.next_start = 0.0
        self.starts = 0
        self.refusal: Optional[Refusal] = None
        self.finished = False

    def tick(self, learner: _Child, printer: _Printer, backoff_max: float) -> Optional[Refusal]:
        """Notice an exit and schedule a restart; start when due and the learner still runs.

        Returns the refusal when this tick found the actor refused for good.
        """
        if self.refusal is not None or self.finished:
            return None
        now = time.monotonic()
        if self.child is not None:
            if self.child.running():
                return None
            self.child.reap()  # its last line is its reason, if it refused
            child, self.child = self.child, None
            self._schedule(child.proc.returncode, now - child.started, printer, backoff_max, child.last_line)
            if self.refusal is not None or self.finished:
                return self.refusal
        # Checked again here: an actor that saw the learner's Shutdown must not come back after it.
        if now >= self.next_start and learner.running():
            self._start(printer, backoff_max)
        return self.refusal  # set when the command could not even be started (127: no such program here)

    def _schedule(self, code: int, ran: float, printer: _Printer, backoff_max: float, last_line: str = "") -> None:
        code = _exit_code(code)
        decision = after_exit(code, ran, self.backoff, backoff_max)
        name = self.spec.name
        if decision.finished:
            self.finished = True
            printer.say(f"{name} finished (exit code {code}: the learner ended its run, or it was stopped on its "
                        "host); not restarting it")
            return
        if not decision.restart:
            self.refusal = Refusal(actor=name, host=self.spec.host, exit_code=code, reason=last_line or "(no output)")
            printer.say(f"{name} refused to run (exit code {code}, permanent); not restarting it: {self.refusal.reason}")
            return
        self.backoff = decision.backoff
        self.next_start = time.monotonic() + decision.delay
        printer.say(f"{name} exited with code {code} after {ran:.1f}s; restarting {name} in {decision.delay:g}s")

    def _start(self, printer: _Printer, backoff_max: float) -> None:
        self.starts += 1
        try:
            self.child = _Child(self.spec.name, self.argv, printer, note=f"start {self.starts}")
        except OSError as exc:  # e.g. no ssh binary: back off like any other failure
            printer.say(f"cannot run {self.argv[0]!r} for {self.spec.name}: {exc}")
            self._schedule(NOT_FOUND, 0.0, printer, backoff_max, f"cannot run {self.argv[0]!r}: {exc}")


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop` for the duration (main thread only: Python's rule for handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _exit_code(returncode: int) -> int:
    # A signal death reads as 128 + signal number, as a shell reports it.
    return returncode if returncode >= 0 else 128 - returncode


def run_fleet(cfg: FleetConfig, *, stop_event: Optional[threading.Event] = None, resume: Optional[str] = None) -> int:
    """Run the learner here and the actors over ssh until the learner exits or we are stopped.

    Returns the learner's exit code. `stop_event` (or SIGINT/SIGTERM when called from the
    main thread) stops the fleet: actors and learner get SIGTERM, the learner checkpoints.
    `resume` continues the run in that directory from its latest checkpoint (the learner's `--resume`).
    """
    stop = stop_event if stop_event is not None else threading.Event()
    printer = _Printer(sys.stdout)
    connect = learner_connect(cfg, resume)
    run = learner_run_config(cfg.learner, resume)
    run_dir = Path(run.run_dir)
    slots = [_ActorSlot(spec, ssh_argv(cfg.ssh, spec.host, actor_command(cfg, spec, connect))) for spec in cfg.actors]
    refusals: list[Refusal] = []
    with _stop_on_signals(stop):
        printer.say(f"actors will dial {connect}")
        for gap in actor_gaps(cfg, run):
            printer.say(f"warning: {gap}")
        if refusals != read_refusals(run_dir):
            record_refusals(run_dir, refusals)  # a new launch tries every actor again
        # Unbuffered: the learner's lines should reach us as they are written, not per 8 KiB.
        learner = _Child("learner", learner_argv(cfg, resume), printer, env={**child_env(), "PYTHONUNBUFFERED": "1"})
        try:
            while not stop.is_set() and learner.running():
                for slot in slots:
                    refused = slot.tick(learner, printer, cfg.restart_backoff_max)
                    if refused is not None:
                        refusals.append(refused)
                        record_refusals(run_dir, refusals)
                stop.wait(POLL_SECONDS)
        finally:
            _wind_down(learner, slots, cfg, stop, printer)
    return _exit_code(learner.proc.returncode)


def _wind_down(learner: _Child, slots: list[_ActorSlot], cfg: FleetConfig, stop: threading.Event, printer: _Printer) -> None:
    """After the learner's exit (or a stop): give actors their chance to leave, then make sure they do."""
    actors = [slot.child for slot in slots if slot.child is not None]
    code = learner.proc.poll()
    if code is None:
        printer.say("stopping: SIGTERM to the actors, then the learner (it writes a checkpoint)")
    elif code != 0:
        printer.say(f"learner exited with code {code}; stopping the actors")  # it told them nothing
    else:
        printer.say(f"learner exited with code 0; waiting up to {ACTOR_GRACE_SECONDS:g}s for actors")
        deadline = time.monotonic() + ACTOR_GRACE_SECONDS
        while any(a.running() for a in actors) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
    _terminate(learner, actors, cfg.stop_timeout, printer)
    printer.say(f"done; learner exit code {learner.proc.returncode}")
