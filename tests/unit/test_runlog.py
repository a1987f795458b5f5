"""Tests for grpo_fleet.learner.records.runlog: the metrics.jsonl and ledger.jsonl writers, and cutting them back."""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path

from grpo_fleet.learner.records.runlog import LedgerEntry, LogSizes, RunLog, StepRecord
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.learner.step.update_stats import UpdateStats

RUN_FILES = Path(__file__).resolve().parents[2] / "docs" / "reference" / "run-files.md"


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, policy_version=step, reward_mean=0.5, reward_std=0.1, loss=0.2, kl=0.01,
                      clip_fraction=0.0, grad_norm=1.0, ratio_mean=1.0, offpolicy_gap_mean=0.05, offpolicy_gap_max=0.9,
                      is_capped_fraction=0.01, completion_length_mean=4.5, completion_length_max=8.0,
                      truncated_fraction=0.25, learning_rate=1e-4, skipped=None,
                      peak_memory_bytes=1, groups=2, tokens=16,
                      staleness_mean=1.0, staleness_max=1, zero_variance_fraction=0.0, step_seconds=0.1, wall_seconds=1.0,
                      actors=2)


def _entry(group_id: str) -> LedgerEntry:
    return LedgerEntry(group_id=group_id, prompt_index=3, actor_id="a", actor_key="k", policy_version=0, step=0)


def test_each_step_and_each_group_is_one_json_line(tmp_path):
    log = RunLog(tmp_path)
    log.step(_record(1))
    log.ledger(_entry("g1"))
    log.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line == {f.name: getattr(_record(1), f.name) for f in fields(StepRecord)}
    assert json.loads((tmp_path / "ledger.jsonl").read_text()) == {
        "group_id": "g1", "prompt_index": 3, "actor_id": "a", "actor_key": "k", "policy_version": 0, "step": 0,
        "zero_variance": False,
    }


# metrics.jsonl's step line, as its readers (plots, bench reports, trackers) know it.
STEP_LINE_KEYS = {
    "step", "policy_version", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "grad_norm", "ratio_mean",
    "offpolicy_gap_mean", "offpolicy_gap_max", "is_capped_fraction", "completion_length_mean", "completion_length_max",
    "truncated_fraction", "learning_rate", "skipped", "peak_memory_bytes", "groups", "tokens", "staleness_mean",
    "staleness_max", "zero_variance_fraction", "step_seconds", "wall_seconds", "actors", "check_seconds", "groups_checked",
    "groups_unchecked", "episode_turns_mean", "tool_calls_per_episode", "tool_call_episode_fraction",
    "tool_call_malformed_fraction",
}


def test_a_step_line_has_the_keys_its_readers_know(tmp_path):
    log = RunLog(tmp_path)
    log.step(_record(1))
    log.close()
    assert set(json.loads((tmp_path / "metrics.jsonl").read_text())) == STEP_LINE_KEYS


def test_a_step_line_keeps_every_stat_of_the_update_and_the_trainer_hands_each_on():
    """A stat declared in UpdateStats reaches both StepStats and metrics.jsonl, with no copy to forget."""
    update = {f.name for f in fields(UpdateStats)}
    assert update <= STEP_LINE_KEYS
    assert update <= {f.name for f in fields(StepStats)}
    stats = StepStats(loss=0.5, kl=0.25, clip_fraction=0.125, grad_norm=2.0, ratio_mean=1.5, offpolicy_gap_mean=0.75,
                      offpolicy_gap_max=3.0, is_capped_fraction=0.0625, learning_rate=1e-3, skipped="nonfinite_grad",
                      peak_memory_bytes=7, policy_objective=0.0, ref_seconds=0.0, update_seconds=0.0, train_seconds=0.0,
                      micro_batches=1, epochs=1)
    record = replace(_record(1), **stats.update_stats())
    assert {name: getattr(record, name) for name in update} == {name: getattr(stats, name) for name in update}


def test_the_run_files_reference_lists_every_step_record_key():
    text = RUN_FILES.read_text()
    listed = text[text.index("Each step appends one JSON line"):text.index("Every accepted group appends")]
    assert set(re.findall(r"`(\w+)`", listed)) >= {f.name for f in fields(StepRecord)}


def test_truncate_forgets_what_was_logged_after_the_sizes_were_taken(tmp_path):
    log = RunLog(tmp_path)
    log.step(_record(1))
    log.ledger(_entry("g1"))
    kept = log.sizes()
    log.step(_record(2))
    log.ledger(_entry("g2"))
    log.truncate(kept)
    log.ledger(_entry("g3"))  # append mode: writing goes on at the new end
    log.close()
    assert [json.loads(x)["group_id"] for x in (tmp_path / "ledger.jsonl").read_text().splitlines()] == ["g1", "g3"]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_truncating_to_nothing_starts_the_logs_over(tmp_path):
    log = RunLog(tmp_path)
    log.ledger(_entry("g1"))
    log.truncate(LogSizes())
    assert log.sizes() == LogSizes(0, 0)
    log.close()
