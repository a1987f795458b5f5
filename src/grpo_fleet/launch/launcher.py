"""`grpo-fleet launch FLEET.toml`: the learner on this machine, every actor over ssh, kept alive.

The fleet file (launch/fleet_file.py) names the learner's run config and one `[[actors]]`
entry per actor. The launcher starts the learner here, then each actor through an ssh
command template, copies every process's output to its own stdout with a
`[learner]` / `[ACTOR]` prefix, restarts actors that exit while the learner runs
(exponential backoff) unless their exit is permanent (runtime/exit_codes.py: a refusal
fails the same way on every start; it is stopped with its reason, recorded in
RUN_DIR/launch.json for `grpo-fleet status --run-dir`), and stops everything
cleanly on Ctrl-C or SIGTERM.

A stop reaches a remote actor through its stdin: the launcher holds a pipe to
each ssh client's stdin and closes it, and the actor (--stdin-lifeline,
actor/lifeline.py) drains and exits; the same happens when the launcher dies
however it dies. The learner then gets SIGTERM, and as long as its measured step
and checkpoint need before SIGKILL (launch/policy.py: learner_stop_wait).

Example::

    ssh = "ssh -o BatchMode=yes -- {host} {command}"
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

import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from grpo_fleet.config import RunConfig
from grpo_fleet.launch.fleet_file import (
    ActorSpec,
    FleetConfig,
    actor_command,
    actor_gaps,
    learner_argv,
    learner_connect,
    learner_run_config,
    ssh_argv,
)
from grpo_fleet.launch.policy import (
    FIRST_BACKOFF_SECONDS,
    LearnerStopWait,
    Refusal,
    after_exit,
    learner_stop_wait,
    read_refusals,
    recent_records,
    record_refusals,
)
from grpo_fleet.launch.processes import Child, Printer, kill_late, wait_all
from grpo_fleet.learner.records.runlog import METRICS_FILE
from grpo_fleet.runtime.blas import child_env
from grpo_fleet.runtime.exit_codes import DONE, NOT_FOUND

# When the learner exits after its last step, every actor has heard Shutdown (each answers it,
# and the learner waits up to 10 s for that), so the actors are on their way out: give them the
# time a loaded Mac takes to wind a Python process down (reward child, sockets, MLX), then stop them.
ACTOR_GRACE_SECONDS = 15.0
# On a stop, actors are stopped first (stdin closed), and get this long to deliver what they hold while the
# learner still listens; then SIGTERM.
ACTOR_DRAIN_SECONDS = 5.0
POLL_SECONDS = 0.2


def _terminate(learner: Child, actors: list[Child], timeout: float, learner_wait: LearnerStopWait,
               printer: Printer) -> None:
    """Stop the actors (their stdin ends), then SIGTERM the learner; SIGKILL an actor still running `timeout`
    after that, and the learner after `learner_wait`, which is sized from its own step and checkpoint times."""
    for actor in actors:
        actor.cut_lifeline()  # the one stop that reaches an actor over ssh
    # Actors first: one holding finished rollouts delivers them while the learner still takes them.
    wait_all(actors, min(ACTOR_DRAIN_SECONDS, timeout))
    for actor in actors:
        actor.signal(signal.SIGTERM)  # an actor whose command forwarded no stdin; over ssh, the client
    learner.signal(signal.SIGTERM)  # it finishes the step in hand and writes a checkpoint
    if learner.running():
        printer.say(f"waiting up to {learner_wait.seconds:.0f}s for the learner's last step and checkpoint "
                    f"({learner_wait.reason})")
    started = time.monotonic()
    wait_all([learner, *actors], timeout)
    kill_late(actors, f"{timeout:g}s", printer)
    wait_all([learner], learner_wait.seconds - (time.monotonic() - started))
    kill_late([learner], f"{learner_wait.seconds:.0f}s", printer,
               "; its steps since the last checkpoint are lost: raise stop_timeout in the fleet file")
    for child in [learner, *actors]:
        child.reap()


class _ActorSlot:
    """One [[actors]] entry: its command line, its current process and its restart schedule."""

    def __init__(self, spec: ActorSpec, argv: list[str]) -> None:
        self.spec = spec
        self.argv = argv
        self.child: Optional[Child] = None
        self.backoff = FIRST_BACKOFF_SECONDS
        self.next_start = 0.0
        self.starts = 0
        self.refusal: Optional[Refusal] = None
        self.finished = False

    def tick(self, learner: Child, printer: Printer, backoff_max: float) -> Optional[Refusal]:
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

    def _schedule(self, code: int, ran: float, printer: Printer, backoff_max: float, last_line: str = "") -> None:
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

    def report_exit(self, printer: Printer) -> None:
        """Say how the actor ended when it outlived the learner, so no tick noticed it: the fleet is winding
        down, and nothing is restarted."""
        if self.child is None or self.child.running():
            return
        self.child.reap()
        code = _exit_code(self.child.proc.returncode)
        if code == DONE:
            printer.say(f"{self.spec.name} finished (exit code {code}: the learner ended its run, or it was stopped "
                        "on its host)")
        else:
            printer.say(f"{self.spec.name} exited with code {code} as the fleet stopped: {self.child.last_line or '(no output)'}")
        self.child = None

    def _start(self, printer: Printer, backoff_max: float) -> None:
        self.starts += 1
        try:
            self.child = Child(self.spec.name, self.argv, printer, note=f"start {self.starts}", lifeline=True)
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
    printer = Printer(sys.stdout)
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
        learner = Child("learner", learner_argv(cfg, resume), printer, env={**child_env(), "PYTHONUNBUFFERED": "1"})
        try:
            while not stop.is_set() and learner.running():
                for slot in slots:
                    refused = slot.tick(learner, printer, cfg.restart_backoff_max)
                    if refused is not None:
                        refusals.append(refused)
                        record_refusals(run_dir, refusals)
                stop.wait(POLL_SECONDS)
        finally:
            wait = learner_stop_wait(recent_records(run_dir / METRICS_FILE), run.train.checkpoint_every,
                                     cfg.stop_timeout)
            _wind_down(learner, slots, cfg, wait, stop, printer)
    _say_how_to_export(run, printer)
    return _exit_code(learner.proc.returncode)


def _say_how_to_export(run: RunConfig, printer: Printer) -> None:
    """The run's last line, once it has a checkpoint: how to take it back to a chat app."""
    from grpo_fleet.export.hint import export_hint
    from grpo_fleet.models.zoo import is_gguf_source  # imports MLX: only now, at the end
    from grpo_fleet.runtime.checkpoint_dirs import latest_checkpoint

    if latest_checkpoint(run.run_dir) is not None:
        printer.say(export_hint(run.run_dir, is_gguf_source(run.model.path)))


def _wind_down(learner: Child, slots: list[_ActorSlot], cfg: FleetConfig, learner_wait: LearnerStopWait,
               stop: threading.Event, printer: Printer) -> None:
    """After the learner's exit (or a stop): give actors their chance to leave, then make sure they do."""
    actors = [slot.child for slot in slots if slot.child is not None]
    code = learner.proc.poll()
    if code is None:
        printer.say("stopping: the actors (their stdin ends, then SIGTERM), then the learner (it writes a checkpoint)")
    elif code != 0:
        printer.say(f"learner exited with code {code}; stopping the actors")  # it told them nothing
    else:
        printer.say(f"learner exited with code 0; waiting up to {ACTOR_GRACE_SECONDS:g}s for actors")
        deadline = time.monotonic() + ACTOR_GRACE_SECONDS
        while any(a.running() for a in actors) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
    _terminate(learner, actors, cfg.stop_timeout, learner_wait, printer)
    for slot in slots:
        slot.report_exit(printer)
    printer.say(f"done; learner exit code {learner.proc.returncode}")
