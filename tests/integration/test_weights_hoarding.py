"""A peer with an allowed key that asks for every new version's weights and never reads them, against a real
learner: the blobs its queued chunks hold stay bounded (learner/door/weights_in_flight.py)."""

from __future__ import annotations

import time

import zmq

from grpo_fleet.learner.door.weights_in_flight import MAX_VERSIONS_IN_FLIGHT
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import add_actor, init_keys, load_keypair, make_client
from grpo_fleet.protocol.client import request_status
from grpo_fleet.protocol.codec import encode
from grpo_fleet.protocol.sockets import recv_message, recv_with_raw
from helpers import scrape, wait_for

HELD = "grpo_fleet_learner_weight_reply_bytes_held"
REFUSED = "grpo_fleet_learner_weights_refusals_total"
VERSIONS = 8  # new versions the hoarder asks for


def _hoarder(ctx: zmq.Context, endpoint: str, secret, learner_key) -> zmq.Socket:
    """A DEALER that takes one message into its queue at most and a few kB into its kernel buffer: its
    libzmq stops reading, so what the learner queues for it stays with the learner."""
    sock = ctx.socket(zmq.DEALER)
    make_client(sock, load_keypair(secret), load_keypair(learner_key).public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.IDENTITY, b"hoarder")
    sock.connect(endpoint)
    return sock


def test_a_peer_asking_every_version_and_never_reading_holds_one_blob(tmp_path, run_config, free_port, spawn):
    keys = tmp_path / "keys"
    init_keys(keys)
    honest, hoarder_key = add_actor(keys, "honest"), add_actor(keys, "hoarder")
    learner_key = keys / "learner.key"
    config, cfg = run_config(train={"steps": 100000, "checkpoint_every": 100000},
                             server={"heartbeat_seconds": 0.5}, security={"keys_dir": str(keys)},
                             metrics={"port": free_port()})
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "honest", "--key", str(honest), "--learner-key",
          str(learner_key), "--metrics-port", "0", "--model-dir", cfg.run_dir, name="honest")
    ctx = zmq.Context()
    sock = _hoarder(ctx, cfg.server.bind, hoarder_key, learner_key)
    try:
        sock.send(encode(m.Hello(actor_id="hoarder", host="h", backend="cpu", versions={})))
        welcome = wait_for(lambda: recv_message(sock, timeout_s=1), "the hoarder's Welcome", 180, (learner,))
        assert isinstance(welcome, m.Welcome), welcome
        sock.send(encode(m.GetWeights(version=welcome.policy_version)))
        first, _ = wait_for(lambda: recv_with_raw(sock, timeout_s=1), "one weight chunk", 30, (learner,))
        blob = first.total_bytes
        assert first.length == blob > 64 * 1024, "one chunk, sent zero-copy: it holds the whole blob"
        for _ in range(30):  # more than the hoarder's buffers take: from here on, its chunks stay queued
            sock.send(encode(m.GetWeights(version=first.version)))
        asked, seen = 0, first.version
        deadline = time.monotonic() + 180
        while asked < VERSIONS:
            assert time.monotonic() < deadline and learner.poll() is None, (
                f"the learner stopped publishing at v{seen}: {actor.log_path.read_text()[-2000:]}")
            version = request_status(cfg.server.bind, key_file=str(honest), learner_key_file=str(learner_key),
                                     timeout_s=30).policy_version
            sock.send(encode(m.Heartbeat(actor_id="hoarder", policy_version=seen)))  # stays registered
            if version != seen:
                sock.send(encode(m.GetWeights(version=version)))
                asked, seen = asked + 1, version
            time.sleep(0.2)
        page = wait_for(lambda: (page := scrape(cfg.metrics.port)).value(REFUSED, reason="peer_busy") >= VERSIONS
                        and page, "the hoarder's requests refused", 30, (learner,))
        held = page.total(HELD)
        assert blob <= held, "the hoarder's queued chunks still hold the blob it first asked for"
        # Its one blob, and the one the honest actor may be fetching: not one per version it asked for.
        assert held <= 2 * blob < MAX_VERSIONS_IN_FLIGHT * blob < VERSIONS * blob
        assert learner.poll() is None
    finally:
        sock.close(linger=0)
        ctx.term()
