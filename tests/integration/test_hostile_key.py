"""One key, hostile but allowed, against a real learner over CURVE (issue 39, items 2 and 5).

The hostile key opens more sessions than it may, asks for every lease it can get,
sends work back unscored at once, and floods Hellos under new ids; the honest key
keeps its share of the in-flight budget, gets the prompts the hostile one sent
back, and its actor id.
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo_fleet.learner.actors.leasing import NEW_ACTOR_LEASES
from grpo_fleet.learner.records.actor_ids import MAX_BOUND_IDS
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import add_actor, client_curve, init_keys
from grpo_fleet.protocol.client import Client
from helpers import scrape, wait_for

SESSIONS = 8  # server.max_sessions_per_key, the default
GROUPS_PER_STEP, IN_FLIGHT_STEPS, PER_LEASE = 4, 4, 2  # 16 groups in flight


def _hello(client: Client, actor_id: str, timeout: float = 30.0) -> m.Welcome | m.ErrorReply:
    reply = client.request(m.Hello(actor_id=actor_id, host="h", backend="cpu", versions={}), timeout)
    assert isinstance(reply, (m.Welcome, m.ErrorReply)), reply
    return reply


def _lease(client: Client) -> m.Lease:
    reply = client.request(m.LeaseRequest(max_groups=PER_LEASE), 30)
    assert isinstance(reply, m.Lease), reply
    return reply


def _unscored(lease: m.Lease, welcome: m.Welcome) -> m.Rollouts:
    return m.Rollouts(lease_id=lease.lease_id, policy_version=lease.policy_version, incarnation=welcome.incarnation,
                      groups=[], unscored=[m.UnscoredGroup(group_id=p.group_id, reward="reverse_positions",
                                                           error="exception") for p in lease.prompts])


def test_one_hostile_key_holds_its_share_steers_nothing_and_takes_no_id(tmp_path: Path, run_config, free_port,
                                                                        spawn):
    keys = tmp_path / "keys"
    init_keys(keys)
    curves = {name: client_curve(add_actor(keys, name), keys / "learner.key") for name in ("honest", "hostile")}
    config, cfg = run_config(
        grpo={"groups_per_step": GROUPS_PER_STEP}, train={"steps": 10**6, "checkpoint_every": 10**6},
        server={"in_flight_steps": IN_FLIGHT_STEPS, "max_groups_per_lease": PER_LEASE, "heartbeat_seconds": 0.5},
        security={"keys_dir": str(keys)}, metrics={"port": free_port()},
    )
    learner = spawn("learner", "--config", str(config), name="learner")
    honest = Client(cfg.server.bind, identity="mac-1", curve=curves["honest"])
    hostile = [Client(cfg.server.bind, identity=f"h-{n}", curve=curves["hostile"]) for n in range(SESSIONS + 1)]
    try:
        assert isinstance(_hello(honest, "mac-1", timeout=240), m.Welcome), "the learner is up"
        welcomes = [_hello(client, f"h-{n}") for n, client in enumerate(hostile)]
        assert all(isinstance(w, m.Welcome) for w in welcomes[:SESSIONS])
        assert welcomes[SESSIONS].reason == "too_many_sessions", welcomes[SESSIONS]
        welcome = welcomes[0]

        # Item 2: every session asks for all it can get; the key holds its fair share plus one lease at most.
        leases = [_lease(client) for _ in range(3) for client in hostile[:SESSIONS]]
        held = sum(len(lease.prompts) for lease in leases)
        assert held == GROUPS_PER_STEP * IN_FLIGHT_STEPS // 2 + PER_LEASE, held  # an even share of two keys

        # Sent back unscored at once: no speed earned, and the prompts go to the other key, not back to it.
        returned = next(lease for lease in leases if lease.prompts)
        ack = hostile[0].request(_unscored(returned, welcome), 30)
        assert isinstance(ack, m.Ack) and set(ack.groups.values()) == {"requeued"}, ack
        again = [p.group_id for _ in range(2) for p in _lease(hostile[0]).prompts]
        sent_back = {p.group_id for p in returned.prompts}
        assert again and not sent_back & set(again), "not back to the key that returned them"
        assert sent_back <= {p.group_id for p in _lease(honest).prompts}
        status = hostile[0].request(m.StatusRequest(), 30)
        speeds = [a.groups_per_second for a in status.actors if a.actor_id == "h-0"]
        unmeasured = NEW_ACTOR_LEASES * PER_LEASE / cfg.server.lease_seconds  # its cap: an unmeasured actor's
        assert speeds and speeds[0] <= unmeasured + 1e-9, speeds
        scraped = scrape(cfg.metrics.port)
        assert scraped.value("grpo_fleet_learner_unscored_requeues_total", to="another_key") == len(sent_back)
        assert scraped.value("grpo_fleet_learner_protocol_errors_total", reason="too_many_sessions") == 1

        # Item 5: the honest actor restarts (its id bound, not in use); the hostile key floods new ids meanwhile.
        honest.close()
        honest = None
        wait_for(lambda: not [a for a in hostile[0].request(m.StatusRequest(), 30).actors if a.actor_id == "mac-1"],
                 "the honest actor dropped as silent", 60, (learner,))
        started = time.monotonic()
        for serial in range(MAX_BOUND_IDS + 64):
            assert isinstance(_hello(hostile[0], f"flood-{serial}"), m.Welcome)
        print(f"{MAX_BOUND_IDS + 64} Hellos in {time.monotonic() - started:.1f} s")
        assert _hello(hostile[0], "mac-1").reason == "id_taken"
        honest = Client(cfg.server.bind, identity="mac-1", curve=curves["honest"])
        assert isinstance(_hello(honest, "mac-1"), m.Welcome), "the honest actor keeps its id"
        assert learner.poll() is None
    finally:
        for client in (honest, *hostile):
            if client is not None:
                client.close()
