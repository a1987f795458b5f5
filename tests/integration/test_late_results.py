"""A lease that outlives its deadline still counts (issue 38): a real learner, a slow actor over TCP.

The actor is the benchmark's simulated one (real sockets and messages, no model):
it sleeps per group, standing in for decoding long answers, and sends no
heartbeat meanwhile, so its first lease (unmeasured, so as big as it asked for)
is not extended but expires and is re-queued. Its result arrives after that,
and is taken: nothing is thrown away, and nothing is counted twice.
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo_fleet.bench.simulated_actor import session
from helpers import audit_ledger, jsonl, scrape, wait_for

ASKED = 4
LEASE_SECONDS = 1.0
HEARTBEAT_SECONDS = 0.5  # silent for 10 of them (5 s) is dropped; heard from within 3 (1.5 s) is extended
SECONDS_PER_GROUP = 0.9  # the first lease, 4 groups, takes 3.6 s: past its 1 s deadline and its one extension
RUN_SECONDS = 8.0


def test_a_lease_that_outlives_its_deadline_is_still_taken(run_config, spawn, free_port):
    metrics_port = free_port()
    config, cfg = run_config(
        train={"steps": 10**6, "checkpoint_every": 10**6},
        # A fixed target: without one, leases are bounded by speed only once two steps have timed the learner.
        server={"max_groups_per_lease": ASKED, "lease_seconds": LEASE_SECONDS, "heartbeat_seconds": HEARTBEAT_SECONDS,
                "lease_target_seconds": 0.5},
        metrics={"port": metrics_port},
        # The simulated actor's rewards and logprobs are made up; what is tested here is the lease's life.
        security={"verify_rewards": False, "verify_logprobs": False},
    )
    learner = spawn("learner", "--config", str(config), name="learner")
    probe = {"endpoint": cfg.server.bind, "identity": "probe", "curve": None, "start": 0.0, "end": 0.0}
    wait_for(lambda: not session(probe, timeout=5.0)["errors"], "the learner answering a Hello", procs=[learner])
    start = time.time()
    job = {"endpoint": cfg.server.bind, "identity": "slow", "curve": None, "max_groups": ASKED,
           "seconds_per_group": SECONDS_PER_GROUP, "start": start, "end": start + RUN_SECONDS}
    out = session(job, timeout=30.0)
    assert learner.poll() is None, learner.log_path.read_text()[-3000:]
    assert not out["errors"], out["errors"]
    assert out["lease_sizes"][0] == ASKED, "an unmeasured actor gets what it asked for"
    assert out["rejected"] == 0 and out["stale_groups"] == 0, out

    scraped = scrape(metrics_port)
    assert scraped.value("grpo_fleet_learner_leases_expired_total") >= 1, "the first lease did expire"
    assert scraped.value("grpo_fleet_learner_late_groups_total", kind="train") >= ASKED
    assert scraped.value("grpo_fleet_learner_rejections_total", reason="stale_lease") == 0
    # The late lease measured the actor: its next leases fit the deadline, so only the first came back late.
    assert max(out["lease_sizes"][1:]) < ASKED, out["lease_sizes"]
    ledger = Path(cfg.run_dir) / "ledger.jsonl"
    wait_for(lambda: len(jsonl(ledger)) >= out["groups"], "the ledger to hold every accepted group", procs=[learner])
    audit = audit_ledger(ledger)  # exactly once
    assert len(audit.accepted) >= out["groups"] >= ASKED
