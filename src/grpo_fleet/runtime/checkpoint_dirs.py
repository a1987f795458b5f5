"""A run's checkpoint directories: their names, which one is complete, which one a resume takes, which go.

`RUN_DIR/checkpoints/step_NNNNNN/` is a step's checkpoint; writing a step again
(the final checkpoint after a step's own, a resume checkpointing at once) goes to
`step_NNNNNN_rK/`, a new directory, never over the one `latest.json` names: the
pointer then moves, and only then is the old one removed. So at every instant
`latest.json` names a complete directory (persistence.save gives the order).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Optional

from grpo_fleet.runtime.durable import write_atomic

STATE_FILE = "learner_state.msgpack"
OPTIMIZER_FILE = "optimizer.safetensors"
LATEST_FILE = "latest.json"
_NAME = re.compile(r"step_(\d+)(?:_r(\d+))?")

log = logging.getLogger("grpo_fleet.checkpoints")


def checkpoint_key(name: str) -> Optional[tuple[int, int]]:
    """(step, rewrite) of a checkpoint directory's name, in the order they were written; None for other names."""
    match = _NAME.fullmatch(name)
    return None if match is None else (int(match[1]), int(match[2] or 0))


def checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if p.is_dir() and checkpoint_key(p.name) is not None]
    return sorted(found, key=lambda p: checkpoint_key(p.name) or (0, 0))


def fresh_checkpoint_path(root: Path, step: int) -> Path:
    """Where step `step`'s checkpoint goes: a name no directory has, so no complete checkpoint is ever replaced."""
    taken = [key[1] for p in checkpoints(root) if (key := checkpoint_key(p.name)) and key[0] == step]
    if not taken:
        return root / f"step_{step:06d}"
    return root / f"step_{step:06d}_r{max(taken) + 1}"


def is_complete(path: Path) -> bool:
    """A checkpoint a resume can load: its state file, weights and optimizer are there and not empty."""
    weights = [path / "adapters.safetensors"] if (path / "adapters.safetensors").exists() else \
        sorted(path.glob("model*.safetensors"))
    needed = [path / STATE_FILE, path / OPTIMIZER_FILE, *weights]
    return bool(weights) and all(p.is_file() and p.stat().st_size > 0 for p in needed)


def point_latest(root: Path, path: Path, meta: dict[str, object]) -> None:
    """Make `latest.json` name `path`, atomically and durably (a power cut leaves the old or the new pointer)."""
    write_atomic(root / LATEST_FILE, json.dumps({"path": path.name, **meta}).encode())


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The checkpoint `latest.json` names, checked complete; else the newest complete one, with a warning; or None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST_FILE
    named: Optional[Path] = None
    if pointer.exists():
        try:
            named = root / str(json.loads(pointer.read_text())["path"])
        except (ValueError, KeyError, TypeError):
            log.warning("%s is unreadable; looking for the newest complete checkpoint", pointer)
    if named is not None and is_complete(named):
        return named
    complete = [p for p in checkpoints(root) if is_complete(p)]
    fallback = complete[-1] if complete else None
    if named is not None or fallback is not None:
        said = f"names {named.name}, which is missing or incomplete" if named is not None else "is missing"
        log.warning("%s %s; resuming from %s", pointer, said,
                    fallback if fallback is not None else "nothing (no complete checkpoint): starting over")
    return fallback


def prune(root: Path, keep_name: str, keep: int) -> None:
    """Remove what a resume no longer needs, once `latest.json` names `keep_name`: staging leftovers, checkpoints
    of a future a resume abandoned (written after the one it resumed from) and the same step's earlier writes,
    and all but the newest `keep` - 1 older ones."""
    # Hidden staging directories (and a models/loading.py: save_checkpoint swap's .old) are what a kill mid-write leaves.
    for leftover in root.glob(".step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    kept = checkpoint_key(keep_name)
    assert kept is not None, keep_name
    older = []
    for path in checkpoints(root):
        key = checkpoint_key(path.name)
        assert key is not None
        if key[0] < kept[0]:
            older.append(path)
        elif key != kept:
            shutil.rmtree(path, ignore_errors=True)
    for stale in older[: max(0, len(older) - keep + 1)]:
        shutil.rmtree(stale, ignore_errors=True)
