"""`grpo-fleet launch FLEET.toml`: the learner on this machine, every actor over ssh, kept alive.

The fleet file (fleet_file.py) names the learner's run config and one `[[actors]]`
entry per actor. The launcher starts the learner here, then each actor through an ssh
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

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from grpo_fleet.blas import child_env
from grpo_fleet.exit_codes import NOT_FOUND
from grpo_fleet.fleet_file import (
    ActorSpec,
    FleetConfig,
    actor_command,
    actor_gaps,
    learner_argv,
    learner_connect,
    learner_run_config,
    ssh_argv,
)
from grpo_fleet.launch_policy import (
    FIRST_BACKOFF_SECONDS,
    Refusal,
    after_exit,
    read_refusals,
    record_refusals,
)

# After the learner's own exit it has already waited (up to 10 s) for every actor to hear
# Shutdown, so actors still running by then are exiting or never will: wait only briefly.
ACTOR_GRACE_SECONDS = 5.0
# On a stop, actors get SIGTERM first and this long to deliver what they hold while the learner still listens.
ACTOR_DRAIN_SECONDS = 5.0
POLL_SECONDS = 0.2


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
