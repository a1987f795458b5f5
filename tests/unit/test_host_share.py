"""What other work left a fleet on a shared host (bench/host_share.py), and a starved process's alone-time."""

from __future__ import annotations

import os
import sys
import time

import pytest

from grpo_fleet.bench.alone import Timed
from grpo_fleet.bench.host_share import HostShare, descendants, host_busy_seconds, process_seconds


def test_other_cores_are_the_hosts_busy_time_less_the_fleets_over_the_wall_time():
    share = HostShare(pids=[])
    share.samples = [(100.0, 50.0, 20.0), (105.0, 55.0, 22.0), (110.0, 65.0, 25.0)]
    assert share.other_cores() == pytest.approx(((65 - 50) - (25 - 20)) / 10)
    share.samples = share.samples[:1]
    assert share.other_cores() == 0.0  # one sample says nothing yet


def test_over_the_measured_steps_the_cores_count_from_that_sample_on():
    share = HostShare(pids=[])
    share.samples = [(100.0, 50.0, 20.0), (105.0, 55.0, 22.0), (110.0, 65.0, 25.0)]
    assert share.other_cores(since=1) == pytest.approx(((65 - 55) - (25 - 22)) / 5)  # 1.4: the start-up left out
    assert share.fleet_cores(since=1) == pytest.approx((25 - 22) / 5)
    assert share.fleet_cores() == pytest.approx((25 - 20) / 10)
    assert share.other_cores(since=2) == 0.0 and share.fleet_cores(since=2) == 0.0  # one sample says nothing


def test_a_process_kept_under_one_core_runs_its_cpu_seconds_alone():
    assert Timed(10.0, 0.4).unstarved() == Timed(4.0, 1.0)
    assert Timed(10.0, 1.6).unstarved() == Timed(10.0, 1.6)  # it had its cores: as measured


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_process_and_the_host_count_their_busy_seconds():
    host, own = host_busy_seconds(), process_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert process_seconds(os.getpid()) >= own + 0.1
    assert host_busy_seconds() >= host + 0.1
    assert process_seconds(2**22 + 7) == 0.0  # no such process
    assert os.getpid() in descendants([os.getppid()]) and os.getpid() not in descendants([os.getpid()])
