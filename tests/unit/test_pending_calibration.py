"""The logprob bound's calibration, measured once by whichever thread asks first (learner/verify/gap_calibration.py).

The learner admits actors before it has measured, so start-up does not wait
for a minute of bfloat16 sampling at long answers: these pin down who measures,
who waits, and what a failed or abandoned measurement leaves.
"""

from __future__ import annotations

import threading

from grpo_fleet.learner.step.gap_bounds import GapBound, default_bound
from grpo_fleet.learner.verify.gap_calibration import HonestBounds, PendingCalibration

MEASURED = (("bfloat16", GapBound(0.004, 0.2)),)


def bounds(calibrated: object) -> HonestBounds:
    return HonestBounds(requested_dtype="bfloat16", calibrated=calibrated)  # type: ignore[arg-type]


def measuring_on_another_thread() -> tuple[PendingCalibration, threading.Thread, threading.Event]:
    """A calibration that another thread has started, and holds until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def slow() -> tuple:
        started.set()
        release.wait(10)
        return MEASURED

    pending = PendingCalibration(slow)
    thread = threading.Thread(target=pending.run)
    thread.start()
    assert started.wait(10)
    return pending, thread, release


def test_the_first_caller_measures_once_and_later_ones_get_the_same_bounds() -> None:
    calls = []
    pending = PendingCalibration(lambda: calls.append(1) or MEASURED)
    assert pending.bounds() == MEASURED
    pending.run()  # the training thread, starting after intake already measured: nothing again
    assert pending.bounds() == MEASURED and calls == [1]


def test_intake_waits_for_the_training_thread_that_is_measuring() -> None:
    pending, trainer, release = measuring_on_another_thread()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(bounds(pending.bounds).of("Device(gpu, 0)")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got, "intake must not judge a group before the bound is measured"
    release.set()
    trainer.join(10)
    waiter.join(10)
    assert got == [MEASURED[0][1]]


def test_a_failed_measurement_leaves_the_fixed_ceilings() -> None:
    def broken() -> tuple:
        raise RuntimeError("out of memory")

    pending = PendingCalibration(broken)
    pending.run()
    assert pending.bounds() == ()
    assert bounds(pending.bounds).of("Device(gpu, 0)") == default_bound("bfloat16", "float32")


def test_a_run_that_stops_before_measuring_releases_the_waiters_without_measuring() -> None:
    calls = []
    pending = PendingCalibration(lambda: calls.append(1) or MEASURED)
    pending.abandon()
    assert pending.bounds() == () and calls == []


def test_abandoning_while_another_thread_measures_still_gives_its_bounds() -> None:
    pending, measuring, release = measuring_on_another_thread()
    pending.abandon()  # the training thread stopping while the verifier thread measures
    release.set()
    assert pending.bounds() == MEASURED
    measuring.join(10)
