"""`grpo-fleet actor --stdin-lifeline`: the actor stops when its standard input ends.

`grpo-fleet launch` starts each actor through ssh without a terminal, so a signal
to the local ssh client never reaches the remote actor: it ran on, reconnecting
to a learner that was gone, and a relaunch met its duplicate id. A terminal
(`ssh -tt`) would turn the dropped connection into a SIGHUP, but only while the
local ssh client dies with the launcher; a launcher killed outright leaves that
client, in a session of its own, holding the connection open. So the launcher
instead holds a pipe to each ssh client's stdin and writes nothing into it. ssh
forwards the end of that input, and the remote actor reads EOF when the launcher
closes the pipe to stop it, when the launcher dies however it dies (the kernel
closes the pipe), and when sshd ends the session (the client was killed, or the
connection dropped).

On EOF the actor stops as on a first SIGTERM: it delivers what it holds (for one
request timeout at most), then exits. Still running `grace` seconds later, it gets
the second signal (stop now); still running after that, it is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger("grpo_fleet.actor")
# After the second signal, the seconds before the actor kills itself: long enough to close its sockets.
KILL_AFTER_SECONDS = 10.0


def stdin_is_watchable(fd: int = 0) -> bool:
    """Whether `fd` can carry the lifeline: open, and not /dev/null (whose EOF would stop the actor at once)."""
    try:
        return not os.path.samestat(os.fstat(fd), os.stat(os.devnull))
    except OSError:  # closed
        return False


def watch_stdin(stop: Callable[[], None], grace: float, fd: int = 0) -> threading.Thread:
    """A daemon thread: read `fd` to its end, then `stop()`, then the second signal after `grace`, then SIGKILL."""
    thread = threading.Thread(target=_watch, args=(fd, stop, grace), name="stdin-lifeline", daemon=True)
    thread.start()
    return thread


def _watch(fd: int, stop: Callable[[], None], grace: float) -> None:
    try:
        while os.read(fd, 4096):  # what is written is ignored: only the end counts
            pass
    except OSError as exc:  # an unreadable stdin is an ended one
        log.warning("stdin unreadable (%s)", exc)
    log.info("stdin closed (the launcher stopped or went away, or its ssh connection dropped): stopping")
    stop()
    time.sleep(grace)
    log.warning("still running %.0fs after stdin closed: stopping now", grace)
    # To the main thread: its handler raises there, and a blocking call it is in returns to run it.
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
    time.sleep(KILL_AFTER_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
