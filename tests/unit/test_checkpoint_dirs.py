"""Tests for grpo_fleet.runtime.checkpoint_dirs: which checkpoint a resume takes, new names for a step written again,
what a prune removes; and for the runlog's refusal of a log shorter than a checkpoint records."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from grpo_fleet.learner.records.runlog import LEDGER_FILE, METRICS_FILE, LedgerEntry, LogSizes, RunLog, ShortLog
from grpo_fleet.models.loading import latest_checkpoint
from grpo_fleet.runtime.checkpoint_dirs import OPTIMIZER_FILE, STATE_FILE, fresh_checkpoint_path, point_latest, prune


def _checkpoint(root: Path, name: str, *, skip: str = "") -> Path:
    path = root / name
    path.mkdir(parents=True)
    for file in ("adapters.safetensors", OPTIMIZER_FILE, STATE_FILE):
        if file != skip:
            (path / file).write_bytes(b"x")
    return path


def test_latest_names_a_complete_checkpoint_and_is_taken(tmp_path):
    root = tmp_path / "checkpoints"
    older, newer = _checkpoint(root, "step_000001"), _checkpoint(root, "step_000002")
    point_latest(root, older, {"step": 1})
    assert latest_checkpoint(tmp_path) == older  # the pointer wins over a newer directory it does not name
    point_latest(root, newer, {"step": 2})
    assert latest_checkpoint(tmp_path) == newer


@pytest.mark.parametrize("broken", ["missing", OPTIMIZER_FILE, STATE_FILE, "adapters.safetensors", "empty"])
def test_latest_naming_an_incomplete_checkpoint_falls_back_to_the_newest_complete_one_with_a_warning(
        tmp_path, caplog, broken):
    root = tmp_path / "checkpoints"
    good = _checkpoint(root, "step_000001")
    _checkpoint(root, "step_000002")
    named = root / "step_000003"
    if broken != "missing":
        _checkpoint(root, named.name, skip=broken)
    if broken == "empty":
        (named / OPTIMIZER_FILE).write_bytes(b"")  # a file whose data never reached the disk
    (root / "step_000002" / STATE_FILE).unlink()  # newer than `good`, but not complete either
    point_latest(root, named, {"step": 3})
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == good
    assert "step_000003" in caplog.text and "step_000001" in caplog.text


def test_no_pointer_takes_the_newest_complete_checkpoint_and_an_empty_run_has_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    root = tmp_path / "checkpoints"
    _checkpoint(root, "step_000001")
    newest = _checkpoint(root, "step_000001_r1")  # renamed into place; killed before latest.json was written
    assert latest_checkpoint(tmp_path) == newest
    (root / "latest.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == newest


def test_a_step_written_again_gets_a_new_directory_in_order(tmp_path):
    root = tmp_path / "checkpoints"
    assert fresh_checkpoint_path(root, 7).name == "step_000007"
    names = []
    for _ in range(12):
        names.append(_checkpoint(root, fresh_checkpoint_path(root, 7).name).name)
    assert names[:3] == ["step_000007", "step_000007_r1", "step_000007_r2"] and names[-1] == "step_000007_r11"
    assert fresh_checkpoint_path(root, 10).name == "step_000010"
    # With no pointer the newest complete one is taken: r11 after r9 (by number, not by text).
    assert latest_checkpoint(tmp_path) == root / "step_000007_r11"


def test_prune_keeps_the_newest_drops_the_same_steps_earlier_writes_and_an_abandoned_future(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_000001", "step_000002", "step_000003", "step_000003_r1", "step_000004", ".step_000003.x1"):
        _checkpoint(root, name)
    # A resume from step 2 trained step 3 again: step_000004 and step_000003 belong to the life before it.
    prune(root, keep_name="step_000003_r1", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003_r1"]


def _runlog_with_lines(run_dir: Path) -> tuple[RunLog, LogSizes]:
    log = RunLog(run_dir)
    for n in range(3):
        log.ledger(LedgerEntry(group_id=f"g{n}", prompt_index=n, actor_id="a", actor_key="k", policy_version=0, step=0))
    return log, log.sizes()


@pytest.mark.parametrize("name", [LEDGER_FILE, METRICS_FILE])
def test_a_resume_refuses_a_log_shorter_than_the_checkpoint_in_one_line_and_cuts_nothing(tmp_path, name):
    log, sizes = _runlog_with_lines(tmp_path)
    recorded = LogSizes(sizes.ledger_bytes + 40, 0) if name == LEDGER_FILE else LogSizes(sizes.ledger_bytes // 2, 50)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ShortLog) as refused:
        log.truncate(recorded)
    message = str(refused.value)
    have, wanted = (sizes.ledger_bytes, recorded.ledger_bytes) if name == LEDGER_FILE else (0, 50)
    assert "\n" not in message and str(tmp_path / name) in message
    assert f"is {have} bytes" in message and f"the {wanted} bytes" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing cut, the ledger included
    log.close()


def test_latest_json_is_replaced_durably_and_names_the_directory(tmp_path):
    root = tmp_path / "checkpoints"
    path = _checkpoint(root, "step_000002")
    point_latest(root, path, {"step": 2})
    assert json.loads((root / "latest.json").read_text()) == {"path": "step_000002", "step": 2}
    assert not list(root.glob("*.tmp"))
