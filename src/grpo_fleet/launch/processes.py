"""The processes `grpo-fleet launch` runs (launch/launcher.py): each in a session of its own, its output copied to ours
line by line with a prefix, and signalled as a group."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from typing import IO, Optional


class Printer:
    """Our stdout, shared by the reader threads; one lock so lines never interleave."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream: Optional[IO[str]] = stream
        self.lock = threading.RLock()  # re-entered by Child, which prints while holding it

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


def copy_lines(pipe: IO[bytes], prefix: str, printer: Printer, last: list[str]) -> None:
    """Reader thread: child output to ours, line by line, until every writer has closed the pipe.

    The last non-blank line is kept in `last`: a refused actor's reason is what it printed last.
    """
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", errors="replace")
            printer.line(prefix, text)
            if text.strip():
                last[:] = [text.strip()]


class Child:
    """One process we started in its own session (so its whole group can be signalled) and its reader."""

    def __init__(self, name: str, argv: list[str], printer: Printer, env: Optional[dict] = None, note: str = "",
                 lifeline: bool = False) -> None:
        self.name = name
        self.started = time.monotonic()
        self._last: list[str] = []  # written by the reader thread
        # Holding the output lock until our "started" line is out keeps it ahead of the child's first line.
        with printer.lock:
            # stdin never our terminal's (ssh must not eat its input): for an actor, a pipe we write nothing
            # into, whose end stops it (actor/lifeline.py), even on its host; else /dev/null. A new
            # session: Ctrl-C on our terminal reaches only us, and we decide who is stopped how.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if lifeline else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
            assert self.proc.stdout is not None
            self.reader = threading.Thread(
                target=copy_lines, args=(self.proc.stdout, f"[{name}] ", printer, self._last), name=f"launch-{name}",
                daemon=True,
            )
            self.reader.start()
            details = ", ".join(filter(None, [note, f"pid {self.proc.pid}"]))
            printer.say(f"started {name} ({details}): {shlex.join(argv)}")

    def running(self) -> bool:
        return self.proc.poll() is None

    def cut_lifeline(self) -> None:
        """Close its stdin: an actor started with --stdin-lifeline stops as on SIGTERM, over ssh too."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def signal(self, signum: int) -> None:
        # Only while the leader is unreaped: until then its pid (our group id) cannot be reused by a stranger.
        if self.running():
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        self.proc.wait()
        self.cut_lifeline()  # its fd, once the process is gone
        # Wait for the last lines, boundedly: a leftover grandchild (an ssh ControlMaster) may hold the pipe open.
        self.reader.join(timeout=2.0)

    @property
    def last_line(self) -> str:
        """What the process printed last (reap first, so the reader has seen it all)."""
        return self._last[0] if self._last else ""


def wait_all(children: list[Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(child.running() for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_late(children: list[Child], waited: str, printer: Printer, why: str = "") -> None:
    for child in children:
        if child.running():
            printer.say(f"{child.name} still running {waited} after SIGTERM; SIGKILL{why}")
            child.signal(signal.SIGKILL)
