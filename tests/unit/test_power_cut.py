"""A power cut at every point of a checkpoint: every resume finds a complete checkpoint and a ledger that matches it.

The file system is the real one; the cut is simulated after the fact, pessimistically, as POSIX allows: the
save is stopped before its k-th file-system step (fsync, rename, replace, rmtree), then a rename whose
directory was not fsynced after it is undone, a file keeps only the bytes it had when last fsynced (none if
never), and a removal stays done. The spies live here: they wrap `os`, `shutil` and `durable.flush_fd`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from test_learner_core import run_config

import grpo_fleet.runtime.durable as durable
from grpo_fleet.learner.records import persistence
from grpo_fleet.learner.records.runlog import (
    LEDGER_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    LedgerEntry,
    LogSizes,
    ShortLog,
)
from grpo_fleet.learner.run.build import build_learner
from grpo_fleet.models.loading import latest_checkpoint


class PowerCut(BaseException):
    """Raised before the k-th step: nothing in the package catches a BaseException."""


@dataclass
class Disk:
    """What reached stable storage, as far as the spies saw: fsynced sizes by inode, renames not yet durable."""

    backups: Path
    cut_at: int = -1  # the step to stop before (-1: never)
    steps: int = 0
    synced: dict[int, int] = field(default_factory=dict)  # inode -> bytes fsynced
    renames: list[tuple[str, str, int, str]] = field(default_factory=list)  # src, dst, parent inode, backup of dst

    def step(self) -> None:
        if self.steps == self.cut_at:
            raise PowerCut()
        self.steps += 1

    def flush_fd(self, real: Callable[[int], None], fd: int) -> None:
        self.step()
        real(fd)
        info = os.fstat(fd)
        self.synced[info.st_ino] = max(self.synced.get(info.st_ino, 0), info.st_size)
        # A directory fsynced makes the renames into it durable.
        self.renames = [r for r in self.renames if r[2] != info.st_ino]

    def rename(self, real: Callable[[Any, Any], None], src: Any, dst: Any) -> None:
        self.step()
        backup = ""
        if os.path.isfile(dst):  # replaced: keep the old file (its inode) to put back if this never hits the disk
            backup = str(self.backups / f"{len(self.renames)}-{self.steps}")
            os.link(dst, backup)
        real(src, dst)
        self.renames.append((str(src), str(dst), os.stat(os.path.dirname(os.path.abspath(dst))).st_ino, backup))

    def rmtree(self, real: Callable[..., None], path: Any, *args: Any, **kwargs: Any) -> None:
        self.step()
        real(path, *args, **kwargs)

    def lose_what_was_not_synced(self, run_dir: Path) -> None:
        for src, dst, _, backup in reversed(self.renames):
            if os.path.lexists(dst) and not os.path.lexists(src):
                os.rename(dst, src)
            if backup:
                os.rename(backup, dst)
        files = [run_dir / name for name in (LEDGER_FILE, METRICS_FILE, SAMPLES_FILE)]
        files += [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file()]
        for path in files:
            keep = self.synced.get(path.stat().st_ino, 0)
            if path.stat().st_size > keep:
                os.truncate(path, keep)


@pytest.fixture
def learner(tiny_model_dir: Path, tmp_path: Path) -> Any:
    built = build_learner(run_config(tiny_model_dir, tmp_path / "run", train={"steps": 5, "keep_checkpoints": 1}))
    yield built
    built.close()


def _spy(monkeypatch: pytest.MonkeyPatch, disk: Disk) -> None:
    real_flush, real_rename, real_replace, real_rmtree = durable.flush_fd, os.rename, os.replace, shutil.rmtree
    monkeypatch.setattr(durable, "flush_fd", lambda fd: disk.flush_fd(real_flush, fd))
    monkeypatch.setattr(os, "rename", lambda src, dst: disk.rename(real_rename, src, dst))
    monkeypatch.setattr(os, "replace", lambda src, dst: disk.rename(real_replace, src, dst))
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: disk.rmtree(real_rmtree, path, *a, **k))


def _log_groups(learner: Any, first: int, count: int) -> None:
    for n in range(first, first + count):
        learner.runlog.ledger(LedgerEntry(group_id=f"g{n}", prompt_index=n, actor_id="a", actor_key="k",
                                          policy_version=learner.state.version, step=learner.state.step))


def _cut_once(learner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_at: int, *, rewrite: bool,
              power: bool) -> bool:
    """Checkpoint, log more, checkpoint again (the same step when `rewrite`) with a kill (`power`: a power cut)
    before step `cut_at`; then resume as a restarted learner would. True when the cut came before the save ended."""
    run_dir = learner.run_dir
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    learner.runlog.truncate(LogSizes())
    learner.state.step = 1
    disk = Disk(backups=tmp_path / f"backups-{rewrite}-{power}-{cut_at}")
    disk.backups.mkdir()
    with monkeypatch.context() as patched:
        _spy(patched, disk)
        _log_groups(learner, 0, 3)
        learner.checkpoint()
        ledgers = {(run_dir / LEDGER_FILE).read_bytes()}
        _log_groups(learner, 3, 2)
        learner.state.step = 1 if rewrite else 2
        ledgers.add((run_dir / LEDGER_FILE).read_bytes())
        disk.cut_at, disk.steps = disk.steps + cut_at, disk.steps
        try:
            learner.checkpoint()
            cut = False
        except PowerCut:
            cut = True
    if power:
        disk.lose_what_was_not_synced(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, f"no checkpoint after a cut at step {cut_at}"
    saved = persistence.load(checkpoint, learner.policy, learner.trainer)  # refuses a short log
    ledger = (run_dir / LEDGER_FILE).read_bytes()[: saved.logs.ledger_bytes]
    assert ledger in ledgers, f"the ledger does not match {checkpoint.name} after a cut at step {cut_at}"
    assert cut or ledger == max(ledgers, key=len), "a save that ended is the one a resume takes"
    return cut


@pytest.mark.parametrize("rewrite", [False, True], ids=["next_step", "same_step_again"])
def test_a_power_cut_at_any_point_of_a_checkpoint_leaves_a_complete_one_and_a_ledger_that_matches(
        learner, tmp_path, monkeypatch, rewrite):
    cut_at = 0
    while _cut_once(learner, tmp_path, monkeypatch, cut_at, rewrite=rewrite, power=True):
        cut_at += 1
    assert cut_at > 5  # the save has that many steps, each cut before


def test_a_kill_while_a_step_is_checkpointed_again_leaves_latest_naming_a_complete_one(
        learner, tmp_path, monkeypatch):
    # Rewriting step_N in place (final -> .old, staging -> final) left latest.json naming nothing between the two.
    cut_at = 0
    while _cut_once(learner, tmp_path, monkeypatch, cut_at, rewrite=True, power=False):
        cut_at += 1
    assert cut_at > 5  # the save has that many steps, each cut before


def test_a_resume_refuses_a_ledger_shorter_than_its_checkpoint_before_loading_anything(learner):
    _log_groups(learner, 0, 3)
    checkpoint = learner.checkpoint()
    ledger = learner.run_dir / LEDGER_FILE
    recorded = persistence.read_state(checkpoint)["ledger_bytes"]
    os.truncate(ledger, recorded - 10)  # a power cut before the ledger's last line reached the disk
    with pytest.raises(ShortLog) as refused:
        persistence.load(checkpoint, learner.policy, learner.trainer)
    message = str(refused.value)
    assert "\n" not in message and str(ledger) in message
    assert f"{recorded - 10} bytes" in message and f"{recorded} bytes" in message
    assert ledger.stat().st_size == recorded - 10  # nothing was cut or changed
