"""Writing so that a power cut keeps it: the data is fsynced, then the directory that names it.

A rename or a new file is only durable once its directory is fsynced, and the
data of a file only once the file is. Checkpoints (learner/records/persistence.py,
models/loading.py: save_checkpoint) and the logs they record lengths of (runlog.sync_logs) go
through here. On macOS `fsync` leaves data in the drive's cache: F_FULLFSYNC flushes it.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system
    fcntl = None  # type: ignore[assignment]


def flush_fd(fd: int) -> None:
    """Push an open file's (or directory's) data to stable storage."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:  # a file system without it (network mounts): plain fsync is the best there is
            pass
    os.fsync(fd)


def sync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory: the names in it, new ones and renamed ones)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        flush_fd(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first, `root` last."""
    directories: list[Path] = []
    for current, _, files in os.walk(root):
        directories.append(Path(current))
        for name in files:
            sync_path(Path(current) / name)
    for directory in reversed(directories):
        sync_path(directory)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that it reads the old or the new content, after a kill or a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            flush_fd(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or an interrupt mid-write: `path` is untouched; leave no half copy beside it
        tmp.unlink(missing_ok=True)
        raise
    sync_path(path.parent)
