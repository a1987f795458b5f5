"""A real learner sizes leases to each actor's speed: a fast and a slow actor over TCP.

The actors are the benchmark's simulated ones (real sockets and messages, no
model): each sleeps a fixed time per group, standing in for generating on a
machine of its own speed.
"""

from __future__ import annotations

import statistics
import threading
import time

from grpo_fleet.bench.simulated_actor import session
from helpers import wait_for

ASKED = 4
SLOW_SECONDS_PER_GROUP = 0.4  # 2.5 groups/s: 2 groups fit the 1 s target
FAST_SECONDS_PER_GROUP = 0.005
RUN_SECONDS = 12.0


def test_fast_actor_gets_full_leases_and_slow_actor_small_ones(run_config, spawn):
    config, cfg = run_config(
        # Room for both actors' leases, so only speed limits a lease. Only accepted groups measure an actor
        # (issue 39): the slow one's would be stale at the fast one's pace, so staleness is no bound here.
        grpo={"groups_per_step": 8, "max_staleness": 1000},
        train={"steps": 10**6, "checkpoint_every": 10**6},
        server={"max_groups_per_lease": ASKED, "lease_target_seconds": 1.0, "lease_seconds": 30.0},
        # The simulated actors' rewards and logprobs are made up; what is tested here is lease sizing.
        security={"verify_rewards": False, "verify_logprobs": False},
    )
    learner = spawn("learner", "--config", str(config), name="learner")
    # The window opens once the learner answers: on a loaded machine its start-up (imports, the tiny
    # model) took longer than the whole window, and the actors' first Hello came back after it closed.
    probe = {"endpoint": cfg.server.bind, "identity": "probe", "curve": None, "start": 0.0, "end": 0.0}
    wait_for(lambda: not session(probe, timeout=5.0)["errors"], "the learner answering a Hello", procs=[learner])
    start = time.time()
    results: dict[str, dict] = {}

    def run(label: str, seconds_per_group: float) -> None:
        job = {"endpoint": cfg.server.bind, "identity": label, "curve": None, "max_groups": ASKED,
               "seconds_per_group": seconds_per_group, "start": start, "end": start + RUN_SECONDS}
        results[label] = session(job, timeout=60.0)

    threads = [threading.Thread(target=run, args=("fast", FAST_SECONDS_PER_GROUP)),
               threading.Thread(target=run, args=("slow", SLOW_SECONDS_PER_GROUP))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert learner.poll() is None, learner.log_path.read_text()[-3000:]
    fast, slow = results["fast"], results["slow"]
    assert not fast["errors"] and not slow["errors"], (fast["errors"], slow["errors"])
    assert slow["lease_sizes"][0] == ASKED, "an unmeasured actor gets what it asked for"
    # Its first lease (what it asked for, 1.6 s) measures it; then 2-group leases.
    assert len(slow["lease_sizes"]) >= 3
    assert set(slow["lease_sizes"][1:]) == {2}, slow["lease_sizes"]
    assert statistics.median(fast["lease_sizes"][1:]) == ASKED, fast["lease_sizes"]
