"""The /metrics (and, on the learner, /sd) HTTP server: a daemon thread serving one process's registry.

Each connection is answered on a thread of its own, at most `max_connections` at once: one more is closed
unanswered and counted (`grpo_fleet_metrics_connections_refused_total`), so a flood of connections cannot grow
the process's threads. A client that sends nothing is cut off after CLIENT_TIMEOUT_SECONDS, freeing its place.
"""

from __future__ import annotations

import json
import logging
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

from grpo_fleet.protocol.endpoints import is_loopback_host

log = logging.getLogger("grpo_fleet.observe.metrics")

# Connections answered at once, by default: Prometheus scrapes with one, a person's curl is another.
MAX_CONNECTIONS = 8
# A connection silent this long is closed: a client that connects and sends nothing must not keep its place.
CLIENT_TIMEOUT_SECONDS = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds would flood the log."""


class BoundedThreading(ThreadingMixIn):
    """ThreadingMixIn with at most `max_connections` threads: a connection beyond them is closed unanswered."""

    daemon_threads = True
    block_on_close = False  # server_close must not wait on a slow client
    max_connections = MAX_CONNECTIONS
    on_refused: Callable[[], None] = staticmethod(lambda: None)
    _slots: Optional[threading.BoundedSemaphore] = None

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots is None:
            self._slots = threading.BoundedSemaphore(self.max_connections)
        if not self._slots.acquire(blocking=False):
            self.on_refused()
            self.shutdown_request(request)  # type: ignore[attr-defined]  # BaseServer's, in the class this mixes into
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # the thread never started
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            assert self._slots is not None
            self._slots.release()


class _ThreadingWSGIServer(BoundedThreading, WSGIServer):
    pass


SdSource = Callable[[], list[dict]]


def metrics_app(registry: CollectorRegistry, sd_targets: Optional[SdSource] = None) -> Callable:
    """WSGI app: /metrics (Prometheus text) and, on the learner, /sd (Prometheus HTTP service discovery)."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if sd_targets is not None and environ.get("PATH_INFO") == "/sd":
            body = json.dumps(sd_targets()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return prometheus(environ, start_response)

    return app


class MetricsServer:
    """A running /metrics (and /sd) HTTP server; `close` stops its thread and frees its port."""

    def __init__(self, server: WSGIServer) -> None:
        self._server = server
        self.port: int = server.server_port
        self._thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        """Stop serving (a scrape in progress finishes) and close the listening socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def exposure_warning(host: str, port: int) -> Optional[str]:
    """What to warn about when /metrics listens beyond loopback: it has no authentication, CURVE or not."""
    if is_loopback_host(host):
        return None
    return (f"metrics on {host or '*'}:{port} answer anyone who reaches them, without authentication (CURVE does "
            "not cover HTTP): /metrics shows actor ids, throughput and rewards, and the learner's /sd lists every "
            "actor's id and host:port. Bind 127.0.0.1 (metrics.host, --metrics-host) unless Prometheus scrapes "
            "from another machine, and then firewall the port to it.")


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, sd_targets: Optional[SdSource] = None, *, any_port: bool = False,
    max_connections: int = MAX_CONNECTIONS,
) -> Optional[MetricsServer]:
    """Serve /metrics (and /sd) from a daemon thread until `close()`; warns when it listens beyond loopback.

    Port 0 disables it (None), unless `any_port` asks the OS for a free one.
    """
    if not port and not any_port:
        return None
    server = make_server(host, port, metrics_app(registry, sd_targets), _ThreadingWSGIServer, handler_class=_QuietHandler)
    server.max_connections = max_connections
    server.on_refused = refusal_counter(registry).inc
    served = MetricsServer(server)
    warning = exposure_warning(host, served.port)
    if warning is not None:
        log.warning("%s", warning)
    return served


def refusal_counter(registry: CollectorRegistry) -> Counter:
    """The count of connections refused because `max_connections` were being answered, in `registry`."""
    name = "grpo_fleet_metrics_connections_refused"
    existing = getattr(registry, "_names_to_collectors", {}).get(f"{name}_total")
    if isinstance(existing, Counter):  # served again from the same registry (an actor retrying another port)
        return existing
    return Counter(name, "Connections to /metrics closed unanswered: metrics.max_connections were being answered",
                   registry=registry)
