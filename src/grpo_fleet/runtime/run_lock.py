"""One learner per run directory: an exclusive lock on RUN_DIR/learner.lock, held for the learner's life.

Two learners on one run directory (a second start, or two `--resume`s) would
both append to the ledger and write checkpoints over each other. The second one
is refused with the pid of the first. The lock is the operating system's
(`flock`, on Linux and macOS): it goes away with the process that holds it,
however that process ends, so a crashed learner leaves no stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Optional

LOCK_FILE = "learner.lock"


class RunDirLocked(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """The lock on a run directory; `with RunDirLock(run_dir):` holds it, or raises RunDirLocked."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: held; the holder wrote its pid
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLocked(f"run directory {self.path.parent} is in use by another learner (pid {holder}); "
                               "stop it first, or use another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the lock; the file stays (a pid is harmless)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        self.release()
