"""Rank 0's doorbell on 127.0.0.1 (protocol/doorbell.py): the other ranks sleep until it rings for the command
they wait for, heartbeats keep them asleep, and silence sends them into the ring unannounced."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from grpo_fleet.protocol.doorbell import REPEAT_SECONDS, BellListener, Doorbell, open_bell

HEARTBEAT = 0.1


def _woken_after(listener: BellListener, command: int, results: list[tuple[bool, float, float]]) -> threading.Thread:
    """A thread waiting on `listener` for `command`: appends (rang, seconds waited, CPU seconds it took)."""

    def wait() -> None:
        started, cpu = time.monotonic(), time.thread_time()
        rang = listener.wait(command)
        results.append((rang, time.monotonic() - started, time.thread_time() - cpu))

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


@contextmanager
def _bell_and_listener(host: str = "127.0.0.1") -> Iterator[tuple[Doorbell, BellListener]]:
    """Rank 0's bell on `host` and a rank subscribed to it; both closed after."""
    bell = Doorbell(host, HEARTBEAT)
    listener = BellListener(bell.endpoint, HEARTBEAT)
    try:
        yield bell, listener
    finally:
        listener.close()
        bell.close()


def test_a_rank_sleeps_through_heartbeats_and_wakes_when_rank0_sends_its_command():
    with _bell_and_listener() as (bell, listener):
        results: list[tuple[bool, float, float]] = []
        waiting = _woken_after(listener, 3, results)
        with bell.ringing(2):  # an earlier command's ring (one this rank has taken already) wakes nobody
            time.sleep(1.0)
        time.sleep(1.0)  # heartbeats only: 20 of them
        assert results == [], "woken by a heartbeat or an old command's ring"
        with bell.ringing(3):
            waiting.join(timeout=5)
        (rang, waited, cpu), = results
        assert rang and 2.0 <= waited < 2.0 + 5 * REPEAT_SECONDS + 1.0
        assert cpu < 0.2, f"the wait took {cpu:.2f} CPU s of {waited:.1f} s: it should sleep, not spin"
        assert listener.missed == 0


def test_a_ring_sent_before_the_rank_subscribed_is_repeated_until_the_broadcast_ends():
    bell = Doorbell("127.0.0.1", HEARTBEAT)
    try:
        with bell.ringing(0):
            listener = BellListener(bell.endpoint, HEARTBEAT)  # subscribes while rank 0 already rings
            try:
                assert listener.wait(0)
            finally:
                listener.close()
    finally:
        bell.close()


def test_three_silent_heartbeats_send_the_rank_into_the_ring_unannounced():
    with _bell_and_listener() as (bell, listener):
        time.sleep(0.5)  # connected, heartbeats queued
        bell.close()  # rank 0 gone: no more heartbeats
        started = time.monotonic()
        assert listener.wait(5) is False
        assert 3 * HEARTBEAT <= time.monotonic() - started < 3 * HEARTBEAT + 2.0
        assert listener.missed == 1


def test_a_rank_on_ipv6_loopback_hears_the_bell_and_an_address_rank0_cannot_bind_gives_no_bell():
    with _bell_and_listener("::1") as (bell, listener):
        assert bell.endpoint.startswith("tcp://[::1]:")
        with bell.ringing(0):
            assert listener.wait(0) and listener.rang == 1
    assert open_bell("192.0.2.1", HEARTBEAT) is None  # TEST-NET-1: not an address of this machine
    assert open_bell(None, HEARTBEAT) is None
