"""Bench two_macs' pure pieces: the bound the split allows, CPU seconds from /proc/PID/stat, per-step deltas,
and the core local_fleet pins each process to."""

from __future__ import annotations

import math

import pytest

from grpo_fleet.bench.two_macs import Mark, cpu_seconds_from_stat, per_step, split_bound, window_tokens
from grpo_fleet.launch.local_fleet import core_of_each


def test_equal_halves_allow_twice_the_speed():
    assert split_bound(30.0, 30.0) == pytest.approx(2.0)


def test_the_longer_half_sets_the_bound_whichever_it_is():
    # 0.6x (a 1/0.6 speed-up) needs the halves within 1.5x of each other.
    assert split_bound(60.0, 40.0) == pytest.approx(100 / 60)
    assert split_bound(40.0, 60.0) == pytest.approx(100 / 60)
    assert split_bound(90.0, 10.0) == pytest.approx(100 / 90)


def test_no_work_has_no_bound():
    assert math.isnan(split_bound(0.0, 0.0))


def test_cpu_seconds_read_past_a_command_name_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    stat = "4242 (python (x) 3) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 7 3 20 0 9 0 77 0 0"
    assert cpu_seconds_from_stat(stat, 100) == pytest.approx((250 + 50 + 7 + 3) / 100)


def test_per_step_divides_each_delta_by_the_steps_between_marks():
    first, last = Mark(1, 100.0, 40.0, 70.0), Mark(4, 190.0, 100.0, 145.0)
    assert per_step(first, last) == pytest.approx((30.0, 20.0, 25.0))


def test_one_mark_has_no_steady_step():
    mark = Mark(3, 10.0, 1.0, 1.0)
    assert all(math.isnan(v) for v in per_step(mark, mark))


def test_window_tokens_count_the_steps_after_the_first_mark():
    tokens = {1: 900.0, 2: 600.0, 3: 400.0}
    assert window_tokens(tokens, 1, 3) == pytest.approx(500.0)


def test_a_window_without_every_step_has_no_tokens_per_step():
    assert math.isnan(window_tokens({1: 900.0, 3: 400.0}, 1, 3))
    assert math.isnan(window_tokens({1: 900.0}, 1, 1))


def test_the_learner_takes_the_first_core_and_each_actor_the_next():
    assert core_of_each([0, 1, 3], actors=2) == [0, 1, 3]
    assert core_of_each(None, actors=2) == [None, None, None]


def test_a_core_list_that_does_not_cover_every_process_is_refused_before_any_starts():
    with pytest.raises(ValueError, match="2 cores for 3 processes"):
        core_of_each([0, 1], actors=2)
