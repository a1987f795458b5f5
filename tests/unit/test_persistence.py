"""Tests for grpo_fleet.learner.records.persistence: the state a checkpoint saves, copied consistently and restored."""

from __future__ import annotations

import time

import numpy as np

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.persistence import (
    capture,
    read_state,
    restore,
    state_from_dict,
    state_to_dict,
    write_state,
)
from grpo_fleet.learner.records.runlog import LogSizes
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.protocol import messages as m


def _group(group_id: str) -> AcceptedGroup:
    completions = [CompletionRecord(tokens=np.array([3, 4], dtype=np.int32), logprobs=np.array([-1.0, -2.0], np.float32),
                                    reward=r, finish_reason="stop") for r in (0.0, 1.0)]
    return AcceptedGroup(group_id=group_id, prompt_index=1, prompt_tokens=np.array([7, 8], dtype=np.int32),
                         completions=completions, policy_version=2, actor_id="a", actor_key="k")


def _state(incarnation: str = "a" * 12) -> LearnerState:
    return LearnerState(run_id="run", incarnation=incarnation, steps_target=10,
                        scheduler=PromptScheduler(6, seed=0, lease_seconds=60.0))


def _busy_state() -> LearnerState:
    state = _state()
    state.step, state.version, state.accepted_since_step = 4, 3, 5
    state.buffer.append(_group("g1"))
    state.scheduler.issue("k", 2)
    state.acks.put("lease", m.Ack(lease_id="lease", status="accepted", groups={"g1": "accepted"}))
    return state


def test_a_capture_does_not_change_when_the_state_moves_on():
    state = _busy_state()
    saved = capture(state, LogSizes(10, 20))
    state.step += 1
    state.buffer.append(_group("g2"))
    state.scheduler.issue("k", 1)
    state.acks.put("later", m.Ack(lease_id="later", status="stale"))
    assert saved.step == 4 and [g.group_id for g in saved.buffer] == ["g1"]
    assert len(saved.scheduler["leases"]) == 1 and list(saved.acks) == ["lease"]


def test_the_state_file_round_trips_with_the_keys_checkpoints_have_always_used(tmp_path):
    saved = capture(_busy_state(), LogSizes(10, 20), bans={"liar": [1, 2, 1.7e9]})
    write_state(tmp_path, state_to_dict(saved))
    data = read_state(tmp_path)
    assert set(data) == {"run_id", "step", "version", "buffer", "acks", "accepted_since_step",
                         "zero_variance_since_step", "scheduler", "ledger_bytes", "metrics_bytes", "samples_bytes",
                         "wall_seconds", "weights_published", "actor_ids", "bans"}
    back = state_from_dict(data)
    assert (back.step, back.version, back.logs, back.acks) == (saved.step, saved.version, saved.logs, saved.acks)
    assert back.bans == {"liar": [1, 2, 1.7e9]}
    del data["bans"]  # as written before bans were saved: a resume lifts them, as every resume did then
    assert state_from_dict(data).bans == {}
    np.testing.assert_array_equal(back.buffer[0].completions[1].logprobs, saved.buffer[0].completions[1].logprobs)
    assert back.buffer[0].actor_key == "k"


def test_checkpoints_record_the_samples_length_and_older_ones_without_it_still_load():
    data = state_to_dict(capture(_busy_state(), LogSizes(10, 20, 30)))
    assert state_from_dict(data).logs == LogSizes(10, 20, 30)
    del data["samples_bytes"]  # as written before samples.jsonl existed: that run had no samples to keep
    assert state_from_dict(data).logs == LogSizes(10, 20, 0)


def test_weights_saved_past_their_version_resume_under_the_next_one_and_older_checkpoints_as_before():
    state = _busy_state()
    state.weights_published = False  # a step that did not publish (train.sync_every > 1)
    data = state_to_dict(capture(state, LogSizes(10, 20)))
    later = _state(incarnation="b" * 12)
    restore(later, state_from_dict(data))
    assert (later.version, later.history_version, later.weights_published) == (4, 3, True)
    del data["weights_published"]  # checkpoints from before the flag resume as they always did
    again = _state(incarnation="c" * 12)
    restore(again, state_from_dict(data))
    assert (again.version, again.history_version) == (3, 3)


def test_restore_resumes_the_run_in_a_new_life():
    saved = capture(_busy_state(), LogSizes(10, 20))
    later = _state(incarnation="b" * 12)
    restore(later, saved)
    assert (later.run_id, later.step, later.version, later.incarnation) == ("run", 4, 3, "b" * 12)
    assert later.history_version == 3, "what the previous life published up to the checkpoint is shared history"
    assert later.scheduler.outstanding_groups == 2 and later.acks.get("lease") == saved.acks["lease"]
    assert [g.group_id for g in later.buffer] == ["g1"]
    assert later.wall_seconds() >= saved.wall_seconds and later.started <= time.monotonic()
