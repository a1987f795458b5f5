"""The /metrics server answers a bounded number of connections at once (issue 29: a thread per connection)."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from grpo_fleet.observe.metrics_http import _ThreadingWSGIServer, refusal_counter


class _HeldServer(_ThreadingWSGIServer):
    """The real server class with its socket work replaced: each answer waits until `release` is set."""

    def __init__(self) -> None:  # no bind: the connections are plain objects
        self.release = threading.Event()
        self.answered: list[str] = []
        self.closed: list[str] = []

    def finish_request(self, request, client_address) -> None:
        self.release.wait(30)
        self.answered.append(request)

    def shutdown_request(self, request) -> None:
        self.closed.append(request)


def _wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_connection_beyond_max_connections_is_closed_unanswered_and_counted():
    registry = CollectorRegistry()
    server = _HeldServer()
    server.max_connections = 2
    server.on_refused = refusal_counter(registry).inc
    for name in ("first", "second", "third"):
        server.process_request(name, ("127.0.0.1", 1))
    assert server.closed == ["third"] and server.answered == []  # refused at once, while two are in hand
    assert registry.get_sample_value("grpo_fleet_metrics_connections_refused_total") == 1
    server.release.set()
    _wait_for(lambda: len(server.closed) == 3)
    assert sorted(server.answered) == ["first", "second"]
    server.process_request("fourth", ("127.0.0.1", 1))  # their places are free again
    _wait_for(lambda: len(server.closed) == 4)
    assert "fourth" in server.answered
    assert registry.get_sample_value("grpo_fleet_metrics_connections_refused_total") == 1


def test_the_refusal_counter_is_registered_once_per_registry():
    registry = CollectorRegistry()
    assert refusal_counter(registry) is refusal_counter(registry)
