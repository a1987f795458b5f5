"""Issue Q's pure pieces: the calibrated per-token bound, the fused check, trust, and finish_reason against tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from grpo_fleet.learner.step.fused_check import check_bounds_array, fused_check
from grpo_fleet.learner.step.gap_bounds import (
    FLOAT32_PAIR_BOUND,
    HALF_PRECISION_BOUND,
    HALF_PRECISION_MEAN_FLOOR,
    GapBound,
    calibrated_bound,
    default_bound,
)
from grpo_fleet.learner.verify.trust import Trust, expected_exposure
from grpo_fleet.protocol.messages import finish_reason_mismatch

EOS = frozenset({2, 7})


def exposure_beyond(share: float, groups: int) -> float:
    """The chance that a sleeper liar trains more than `groups` groups before one is checked."""
    return (1.0 - share) ** groups


def test_a_calibrated_half_precision_bound_follows_the_honest_gaps_of_this_model() -> None:
    ceiling = default_bound("bfloat16", "float32")
    tiny = calibrated_bound(ceiling, [0.0011, 0.0023, 0.0015], [0.004, 0.01])
    # The tiny model's honest bf16 groups reach 0.0023: 3x that, far under the one-size 0.15.
    assert tiny.mean == pytest.approx(3 * 0.0023)
    assert tiny.mean < HALF_PRECISION_BOUND / 10
    # A bf16 actor serving weights a version stale: its smallest group gap on this model was 0.0045, mean 0.0115.
    assert tiny.judge(0.0115, 0.05) == "mean"
    # Never under the floor, never over the ceiling.
    assert calibrated_bound(ceiling, [1e-6], [1e-6]).mean == HALF_PRECISION_MEAN_FLOOR
    assert calibrated_bound(ceiling, [0.2], [3.0]) == ceiling


def test_a_float32_pair_keeps_its_ceiling_whatever_the_calibration_saw() -> None:
    ceiling = default_bound("float32", "float32")
    assert ceiling.mean == FLOAT32_PAIR_BOUND
    assert calibrated_bound(ceiling, [1e-8], [1e-7]) == ceiling


def test_a_few_large_spikes_pass_the_mean_but_not_the_token_bound() -> None:
    bound = default_bound("bfloat16", "float32")
    reported = np.full(1600, -1.0)
    honest = reported + np.random.default_rng(0).normal(0, 0.04, 1600)
    spiked = reported.copy()
    spiked[:8] += 20.0  # 8 tokens of 1,600 off by 20 nats: 0.1 on the mean, with the honest noise under 0.15
    mean = float(np.abs(spiked - honest).mean())
    assert mean < bound.mean  # what the mean alone let through
    assert bound.judge(mean, float(np.abs(spiked - honest).max())) == "token"
    assert bound.judge(float(np.abs(reported - honest).mean()), float(np.abs(reported - honest).max())) is None


def _grid(groups: int, per_group: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = (rng.random((groups * per_group, width)) < 0.7).astype(np.float32)
    return rng.normal(-2.0, 1.0, mask.shape).astype(np.float32) * mask, mask


def test_the_fused_check_judges_only_the_groups_it_is_given_and_only_masked_tokens() -> None:
    recomputed, mask = _grid(3, 4, 20)
    reported = recomputed.copy()
    reported[4:8][mask[4:8] != 0] += 0.5  # group 1 lies everywhere
    reported[8:12][mask[8:12] == 0] += 30.0  # group 2 "lies" only where nothing trains
    bound = GapBound(0.01, 0.1)
    every = fused_check(recomputed, reported, mask, check_bounds_array([bound, bound, bound]))
    assert [(c.index, c.broke) for c in every] == [(0, None), (1, "mean"), (2, None)]
    assert every[1].mean == pytest.approx(0.5, rel=1e-5)
    # Unchecked groups (None) are not judged at all: the liar goes unseen when not picked.
    assert [c.index for c in fused_check(recomputed, reported, mask, check_bounds_array([bound, None, bound]))] == [0, 2]


def test_one_spiked_token_fails_the_fused_check_by_the_token_bound() -> None:
    recomputed, mask = _grid(1, 8, 200, seed=1)
    reported = recomputed.copy()
    row, col = 3, int(np.flatnonzero(mask[3])[5])
    reported[row, col] += 2.0
    (checked,) = fused_check(recomputed, reported, mask, check_bounds_array([GapBound(0.01, 0.5)]))
    assert checked.broke == "token" and checked.worst == pytest.approx(2.0)


def test_the_screen_judges_an_older_group_by_its_worst_token_only_and_says_screen() -> None:
    recomputed, mask = _grid(3, 8, 200, seed=2)
    reported = recomputed + np.float32(0.3) * mask  # every group drifted 0.3 nats a token: a few versions on
    row, col = 9, int(np.flatnonzero(mask[9])[7])
    reported[row, col] -= 20.0  # group 1 hides one spike in one completion
    bounds = check_bounds_array([GapBound(0.01, 0.1), None, None], screens={1: 8.0, 2: 8.0})
    checked = fused_check(recomputed, reported, mask, bounds)
    assert [(c.index, c.broke) for c in checked] == [(0, "mean"), (1, "screen"), (2, None)]
    assert checked[1].worst == pytest.approx(19.7, rel=1e-5), "drift the mean alone never judges"


def test_probation_checks_every_group_then_a_share_and_a_new_hello_starts_it_again() -> None:
    trust = Trust(probation_groups=3, share=0.25, draw=random.Random(1))
    assert all(trust.wants_check("a") for _ in range(50))  # nothing passed yet
    trust.record_pass("a", 3)
    draws = [trust.wants_check("a") for _ in range(4000)]
    assert 0.2 < float(np.mean(draws)) < 0.3
    trust.begin_probation("a")
    assert trust.on_probation("a") and all(trust.wants_check("a") for _ in range(50))
    assert trust.on_probation("someone new")


def test_the_trust_record_stays_bounded_whatever_keys_send(monkeypatch) -> None:
    """Issue 39 item 10: without CURVE every fresh routing id that sent garbage (a violation) grew Trust.passed."""
    import grpo_fleet.learner.verify.trust as trust_module

    trust = Trust(probation_groups=2, share=0.25, draw=random.Random(1))
    for serial in range(10_000):
        trust.begin_probation(f"routing-{serial}")
    assert trust.passed == {} and trust.on_probation("routing-7")
    monkeypatch.setattr(trust_module, "MAX_TRUSTED_KEYS", 3)
    for key in ("old", "a", "b"):
        trust.record_pass(key, 2)
    trust.record_pass("old")  # passed again lately: kept over "a"
    trust.record_pass("c", 2)
    assert sorted(trust.passed) == ["b", "c", "old"]
    assert trust.on_probation("a") and not trust.on_probation("old"), "a forgotten key is checked in full again"


def test_a_sleeper_liar_trains_what_the_geometric_law_says_before_it_is_seen() -> None:
    trust = Trust(probation_groups=0, share=0.2, draw=random.Random(7))
    trained = []
    for _ in range(4000):
        count = 0
        while not trust.wants_check("sleeper"):
            count += 1
        trained.append(count)
    assert expected_exposure(0.2) == pytest.approx(4.0)
    assert float(np.mean(trained)) == pytest.approx(4.0, rel=0.08)
    assert float(np.mean(np.array(trained) > 20)) == pytest.approx(exposure_beyond(0.2, 20), abs=0.006)


@pytest.mark.parametrize(("tokens", "reason", "max_tokens", "lie"), [
    ([5, 6, 2], "stop", 8, False),
    ([5, 6, 7], "stop", 3, False),  # a stop token wins over the length
    ([5, 6, 9], "length", 3, False),
    ([5, 6, 9], "stop", 3, True),  # cut off, claimed finished: escapes grpo.mask_truncated
    ([5, 6, 9], "stop", 8, True),
    ([5, 6, 2], "length", 3, True),
    ([5, 6], "length", 3, True),  # "length" short of max_tokens
    ([5, 2, 6, 2], "stop", 8, True),  # tokens after the stop token
])
def test_finish_reason_is_checked_against_the_tokens(tokens: list[int], reason: str, max_tokens: int, lie: bool) -> None:
    assert finish_reason_mismatch(np.array(tokens, np.int32), reason, EOS, max_tokens) is lie
