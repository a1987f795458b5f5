"""The guarded child's parts that need no process (runtime/child.py); the child itself is tested in
tests/integration/test_guarded_child.py."""

from __future__ import annotations

import signal
import time

import pytest

from grpo_fleet.runtime.child import CallTimedOut, ChildDied, call_deadline, sigint_ignored


def test_call_deadline_interrupts_python_code_that_swallows_every_exception() -> None:
    started = time.monotonic()
    with pytest.raises(CallTimedOut):
        with call_deadline(0.05):
            try:
                time.sleep(5)
            except Exception:  # a user's catch-all: the timer's exception is not an Exception
                pass
    assert time.monotonic() - started < 2


def test_call_deadline_is_disarmed_after_a_call_in_time_and_leaves_the_handler_as_it_found_it() -> None:
    before = signal.getsignal(signal.SIGALRM)
    with call_deadline(0.2):
        pass
    time.sleep(0.4)  # an armed timer would raise here
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == before


def test_sigint_is_ignored_while_a_child_starts_and_restored_after() -> None:
    before = signal.getsignal(signal.SIGINT)
    with sigint_ignored():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == before


@pytest.mark.parametrize(("exitcode", "outside"), [(-signal.SIGTERM, True), (-signal.SIGHUP, True),
                                                   (-signal.SIGKILL, False), (3, False), (None, False)])
def test_only_a_stop_signal_counts_as_stopped_from_outside(exitcode, outside) -> None:
    assert ChildDied(exitcode).stopped_from_outside is outside
