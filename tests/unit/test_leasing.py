"""Tests for grpo_fleet.learner.leasing: lease sizing from measured actor speed, in-flight capacity, retry-after."""

from __future__ import annotations

import pytest

from grpo_fleet.learner.leasing import DEADLINE_SHARE, MovingAverage, lease_size, lease_target_seconds


def test_moving_average_starts_at_the_first_sample_then_follows_new_ones():
    average = MovingAverage(weight=0.5)
    assert average.value is None
    assert average.add(10.0) == 10.0
    assert average.add(20.0) == 15.0
    for _ in range(30):
        average.add(2.0)
    assert average.value == pytest.approx(2.0, abs=1e-6)


def test_an_unmeasured_actor_gets_what_it_asked_for_within_the_limit():
    assert lease_size(requested=8, limit=4, groups_per_second=None, target_seconds=1.0) == 4
    assert lease_size(requested=3, limit=16, groups_per_second=None, target_seconds=1.0) == 3


def test_lease_is_what_the_actor_finishes_in_the_target_time():
    # 2.5 groups/s for 2 s: 5 groups.
    assert lease_size(requested=16, limit=16, groups_per_second=2.5, target_seconds=2.0) == 5


def test_faster_actors_get_more_groups_in_proportion_to_their_speed():
    slow = lease_size(requested=64, limit=64, groups_per_second=1.0, target_seconds=4.0)
    fast = lease_size(requested=64, limit=64, groups_per_second=6.0, target_seconds=4.0)
    assert (slow, fast) == (4, 24)


def test_a_very_slow_actor_still_gets_one_group():
    assert lease_size(requested=8, limit=8, groups_per_second=0.01, target_seconds=1.0) == 1


@pytest.mark.parametrize("requested, limit", [(0, 8), (8, 0), (-1, 4)])
def test_no_lease_without_room_or_without_a_request(requested, limit):
    assert lease_size(requested=requested, limit=limit, groups_per_second=100.0, target_seconds=1.0) == 0


def test_no_target_yet_means_no_speed_bound():
    assert lease_size(requested=8, limit=6, groups_per_second=0.1, target_seconds=None) == 6


def test_default_target_is_max_staleness_learner_steps():
    assert lease_target_seconds(None, max_staleness=2, step_interval=0.5, lease_seconds=60.0) == 1.0
    # On-policy runs (max_staleness 0) still allow one step.
    assert lease_target_seconds(None, max_staleness=0, step_interval=0.5, lease_seconds=60.0) == 0.5


def test_target_is_unknown_before_the_first_steps_unless_fixed():
    assert lease_target_seconds(None, max_staleness=2, step_interval=None, lease_seconds=60.0) is None
    assert lease_target_seconds(3.0, max_staleness=2, step_interval=None, lease_seconds=60.0) == 3.0


def test_target_stays_well_inside_the_lease_deadline():
    assert lease_target_seconds(None, max_staleness=4, step_interval=30.0, lease_seconds=60.0) == DEADLINE_SHARE * 60.0
    assert lease_target_seconds(100.0, max_staleness=2, step_interval=None, lease_seconds=60.0) == DEADLINE_SHARE * 60.0
