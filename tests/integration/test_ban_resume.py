"""A ban survives `grpo-fleet learner --resume` (issue 39, item 4): the banned key's Hello goes unanswered, another
key's is welcomed."""

from __future__ import annotations

from grpo_fleet.learner.actors.bans import peer_key
from grpo_fleet.learner.run.build import build_learner
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode
from helpers import scrape, wait_for

LIAR, HONEST = b"liar", b"honest"


def _hello(sock, actor_id: str) -> None:
    sock.send(encode(m.Hello(actor_id=actor_id, host="h", backend="cpu", versions={})))


def test_a_liar_banned_before_the_checkpoint_is_still_banned_after_a_resume(run_config, spawn, free_port,
                                                                          peer_socket):
    port = free_port()
    _, cfg = run_config(metrics={"port": port})
    learner = build_learner(cfg)
    learner.registry.record_violation(peer_key(LIAR, None), "logprob_mismatch", ban_now=True)  # a failed check
    learner.checkpoint()
    learner.close()
    resumed = spawn("learner", "--resume", cfg.run_dir, name="resumed")
    wait_for(lambda: scrape(port).value("grpo_fleet_learner_banned_peers") == 1, "the ban restored",
             procs=[resumed])
    honest = peer_socket(cfg.server.bind, HONEST)
    _hello(honest, "honest")
    assert honest.poll(30_000) and isinstance(decode(honest.recv()), m.Welcome), "the learner answers Hellos"
    liar = peer_socket(cfg.server.bind, LIAR)
    _hello(liar, "liar")
    assert not liar.poll(2_000), "a banned key's Hello is dropped unanswered"
    assert scrape(port).value("grpo_fleet_learner_protocol_errors_total", reason="banned") >= 1
