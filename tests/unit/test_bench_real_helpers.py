"""The real-model rows' pure helpers: idle batch slots, batch_generate's token count, micro-batch padding."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_fleet.bench import real_decode
from grpo_fleet.bench.real_decode import REAL_MODEL_ENV, idle_slot_share, real_model_dir, returned_token_count
from grpo_fleet.bench.real_step import batch_padding, micro_batch_padding, padding_share
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import build_train_batch, row_lengths, split_batch


def test_equal_lengths_leave_no_slot_idle():
    assert idle_slot_share([5, 5, 5, 5]) == 0.0


def test_finished_sequences_idle_until_the_longest_ends():
    # 4 slots x 8 steps = 32 cells; the sequences fill 8 + 2 + 2 + 4 = 16 of them.
    assert idle_slot_share([8, 2, 2, 4]) == pytest.approx(0.5)


def test_waiting_sequences_refill_freed_slots():
    # 2 slots: [4] | [1, 1, 2] back to back -> both slots busy for 4 steps, nothing idle.
    assert idle_slot_share([4, 1, 1, 2], batch_size=2) == 0.0
    # 2 slots: [3, 1] then the last 3 takes the slot freed first (after 1 step): ends at 4, the other at 4.
    assert idle_slot_share([3, 1, 3], batch_size=2) == pytest.approx(1 - 7 / 8)


def test_idle_share_refuses_empty_sequences_and_handles_none():
    assert idle_slot_share([]) == 0.0
    with pytest.raises(ValueError):
        idle_slot_share([3, 0])


def test_batch_generate_count_adds_the_dropped_stop_token():
    assert returned_token_count([7, 8, 9], max_tokens=8) == 4  # stopped on EOS, which batch_generate dropped
    assert returned_token_count(list(range(8)), max_tokens=8) == 8  # ran to max_tokens: nothing dropped


def test_real_model_dir_prefers_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(REAL_MODEL_ENV, str(tmp_path / "env"))
    assert real_model_dir(tmp_path / "arg") == tmp_path / "arg"
    assert real_model_dir() == tmp_path / "env"
    monkeypatch.delenv(REAL_MODEL_ENV)
    imported: list[str] = []
    monkeypatch.setattr(real_decode, "import_source", lambda source, cache: imported.append(source) or tmp_path / "zoo")
    assert real_model_dir() == tmp_path / "zoo" and imported == ["zoo:smollm2-135m-instruct"]


def test_padding_share_counts_pad_positions_over_all_positions():
    assert padding_share([(2, 16), (4, 8)], real_positions=48) == pytest.approx(1 - 48 / 64)
    assert padding_share([], 0) == 0.0
    with pytest.raises(ValueError):
        padding_share([(1, 4)], real_positions=5)


def _group(index: int, prompt_len: int, completion_lens: list[int]) -> AcceptedGroup:
    return AcceptedGroup(
        group_id=f"g{index}", prompt_index=index, prompt_tokens=np.arange(1, prompt_len + 1, dtype=np.int32),
        completions=[CompletionRecord(np.full(n, 3, np.int32), np.zeros(n, np.float32), float(i), "stop")
                     for i, n in enumerate(completion_lens)],
        policy_version=0, actor_id="test",
    )


def test_micro_batch_padding_matches_a_count_by_hand():
    # Rows need prompt + completion - 1 positions: 4+20-1 = 23 and 4+2-1 = 5 (twice), 4+3-1 = 6.
    batch = build_train_batch([_group(0, 4, [20, 2]), _group(1, 4, [2, 3])])
    lengths = row_lengths(np.array(batch.mask))
    assert list(lengths) == [23, 5, 5, 6]
    # One padded batch: 4 rows x 32 (23 bucketed to 32) = 128 positions for 39 real ones.
    assert batch_padding(batch) == pytest.approx(1 - 39 / 128)
    # A 48-token budget: the long row alone (1 x 32), the three short ones together (3 x 16).
    micro = split_batch(batch, 48)
    assert sorted((int(m.inputs.shape[0]), int(m.inputs.shape[1])) for m in micro) == [(1, 32), (3, 16)]
    assert micro_batch_padding(micro, lengths) == pytest.approx(1 - 39 / 80)


def _learner_page(rejections: dict[str, int], gaps: list[float]):
    from prometheus_client import generate_latest

    from grpo_fleet.bench.scraping import parse
    from grpo_fleet.observe.metrics import learner_metrics

    metrics = learner_metrics()
    for reason, count in rejections.items():
        metrics.rejections.labels(reason=reason).inc(count)
    for gap in gaps:
        metrics.logprob_gap.observe(gap)
    return parse(generate_latest(metrics.registry).decode())


def test_the_real_row_counts_accusing_rejections_of_its_honest_fleet_as_false():
    from grpo_fleet.bench import Report
    from grpo_fleet.bench.real import verification_figure

    report = Report()
    verification_figure(report, _learner_page({"stale_policy": 3}, [2e-6, 3e-6]))
    verification_figure(report, _learner_page({"stale_policy": 1, "logprob_mismatch": 2, "reward_mismatch": 1}, [0.3]))
    verification_figure(report, None)
    clean, accused, silent = report.figures
    assert clean.value == 0 and "2 logprob checks" in clean.notes and "<= 1e-05" in clean.notes, clean.notes
    assert "stale_policy': 3" in clean.notes, "stale refusals are listed but are not false accusations"
    assert accused.value == 3 and "'logprob_mismatch': 2" in accused.notes
    assert np.isnan(silent.value) and "never answered" in silent.notes
