"""A message over the learner's inbound limit is dropped by libzmq with its connection: it must still be counted."""

from __future__ import annotations

import time

import zmq

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode
from helpers import scrape, wait_for

DROPPED = "grpo_fleet_learner_connections_dropped_total"
OVERSIZED_BYTES = 4 << 20  # far over what a lease of 2 groups of 4 x 4 tokens can need (~70 kB)


def _say_hello(sock: zmq.Socket, learner, timeout: float = 120.0) -> m.Welcome:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-2000:]
        sock.send(encode(m.Hello(actor_id="big-sender", host="h", backend="cpu", versions={})))
        if sock.poll(1000):
            reply = decode(sock.recv())
            assert isinstance(reply, m.Welcome), reply
            while sock.poll(1000):  # Hellos queued before the learner bound are answered too
                sock.recv()
            return reply
    raise AssertionError("learner never answered")


def test_an_oversized_message_is_counted_as_a_dropped_connection(run_config, free_port, spawn, peer_socket):
    port = free_port()
    config, cfg = run_config(metrics={"port": port}, train={"steps": 1000})
    learner = spawn("learner", "--config", str(config), name="learner")
    sock = peer_socket(cfg.server.bind, b"big-sender")
    _say_hello(sock, learner)
    time.sleep(1.5)  # housekeeping (every 0.5 s) has read the monitor since the Hello
    before = scrape(port)
    assert before.total(DROPPED) == 0, "no connection has ended yet"
    sock.send(b"\x81" + b"\x00" * OVERSIZED_BYTES)  # never decoded: libzmq stops it at MAXMSGSIZE
    wait_for(lambda: scrape(port).total(DROPPED) >= 1, "the dropped connection to be counted", timeout=30,
             procs=[learner])
    assert not sock.poll(200), "libzmq answers nothing: the count is the only trace"
    after = scrape(port)
    assert after.total("grpo_fleet_learner_protocol_errors_total") == before.total(
        "grpo_fleet_learner_protocol_errors_total"), "the message never reached the request loop"
    assert learner.poll() is None
