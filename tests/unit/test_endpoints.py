"""The endpoint rules: wildcards, loopback, the address a peer dials, the PUB default."""

from __future__ import annotations

import pytest

from grpo_fleet.observe.metrics_http import exposure_warning
from grpo_fleet.protocol.doorbell import check_bell_endpoint
from grpo_fleet.protocol.endpoints import (
    advertised,
    dialable,
    endpoint_host,
    is_loopback_endpoint,
    is_loopback_host,
    is_wildcard_host,
    pub_endpoint_for,
    reachable_host,
    with_host,
)


@pytest.mark.parametrize("host", [None, "", "0.0.0.0", "*", "::", "[::]"])
def test_wildcards_are_every_bind_only_host(host):
    assert is_wildcard_host(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "studio-1.local", "192.168.1.10"])
def test_real_hosts_are_not_wildcards(host):
    assert not is_wildcard_host(host)


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://127.1.2.3:1", True), ("ipc:///tmp/x", True), ("inproc://learner", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://192.168.1.10:5555", False),
    ("tcp://eth0:5555", False),
])
def test_loopback_detection(endpoint, loopback):
    assert is_loopback_endpoint(endpoint) is loopback


@pytest.mark.parametrize("endpoint, expected", [
    ("tcp://0.0.0.0:5555", "tcp://mac:5555"),
    ("tcp://*:5555", "tcp://mac:5555"),
    ("tcp://[::]:5555", "tcp://mac:5555"),
    ("tcp://:5555", "tcp://mac:5555"),
    ("tcp://10.0.0.7:5555", "tcp://10.0.0.7:5555"),
    ("tcp://[fe80::1]:5555", "tcp://[fe80::1]:5555"),
])
def test_dialable_replaces_only_a_wildcard(endpoint, expected):
    assert dialable(endpoint, "mac") == expected


def test_an_ipv6_fallback_gets_brackets():
    assert dialable("tcp://0.0.0.0:5556", "fe80::2") == "tcp://[fe80::2]:5556"
    assert with_host("tcp://x:1", "[::1]") == "tcp://[::1]:1"


def test_endpoint_host_and_reachable_host():
    assert endpoint_host("tcp://[::1]:5555") == "::1"
    assert endpoint_host("tcp://:5555") == ""
    assert reachable_host("0.0.0.0", "learner.local") == "learner.local"
    assert reachable_host("10.0.0.7", "learner.local") == "10.0.0.7"


@pytest.mark.parametrize("bind, pub", [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
    ("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556"),
    ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"),  # a random ROUTER port: a random PUB port too
])
def test_pub_endpoint_defaults_to_the_next_port(bind, pub):
    assert pub_endpoint_for(bind) == pub


def test_advertised_host_replaces_the_bound_one():
    assert advertised("tcp://0.0.0.0:5556", "learner.local") == "tcp://learner.local:5556"
    assert advertised("tcp://0.0.0.0:5556", None) == "tcp://0.0.0.0:5556"  # the actor resolves it


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_metrics_on_loopback_are_not_warned_about(host: str) -> None:
    assert is_loopback_host(host)
    assert exposure_warning(host, 9400) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "192.168.1.10", "studio.local"])
def test_metrics_beyond_loopback_are_warned_about_with_what_they_expose(host: str) -> None:
    warning = exposure_warning(host, 9400)
    assert warning is not None
    assert ":9400" in warning and "without authentication" in warning
    assert "actor ids" in warning and "/sd" in warning and "host:port" in warning


def test_rank0s_doorbell_must_be_a_tcp_ip_and_port():
    assert check_bell_endpoint("tcp://127.0.0.1:40000") == "tcp://127.0.0.1:40000"
    assert check_bell_endpoint("tcp://[::1]:5") == "tcp://[::1]:5"
    for bad in ("ipc:///tmp/x", "tcp://example.com:1", "tcp://127.0.0.1", "tcp://127.0.0.1:1; rm", 7, None,
                "tcp://127.0.0.1:123456"):
        with pytest.raises(ValueError, match="doorbell"):
            check_bell_endpoint(bad)
