"""Chaos: SIGKILL actors at random moments and the learner once; nothing is lost or counted twice."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import mlx_lm
import pytest

from grpo_fleet.learner.state import read_state
from grpo_fleet.model import latest_checkpoint

STEPS = 400
ACTOR_KILLS = 6


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_fleet_survives_sigkills_without_losing_or_duplicating_groups(run_config, spawn):
    # Short leases and heartbeats so killed actors' work is re-queued within the test;
    # frequent checkpoints so the killed learner resumes close to where it died.
    config, cfg = run_config(
        task={"num_train": 300},
        train={"steps": STEPS, "checkpoint_every": 5},
        server={"lease_seconds": 3.0, "heartbeat_seconds": 0.5, "max_groups_per_lease": 2},
    )
    run_dir, bind = Path(cfg.run_dir), cfg.server.bind
    rng = random.Random(20261201)

    def start_actor(index: int):
        return spawn("actor", "--connect", bind, "--actor-id", f"chaos-{index}", "--metrics-port", "0",
                     "--request-timeout", "3", "--model-dir", str(run_dir), name=f"actor{index}")

    learner = spawn("learner", "--config", str(config), name="learner")
    actors = [start_actor(i) for i in range(3)]
    actor_kills, learner_kills = 0, 0
    # Actor kills around one learner kill, at random moments while training runs.
    events = ["actor"] * 3 + ["learner"] + ["actor"] * (ACTOR_KILLS - 3)
    for event in events:
        time.sleep(rng.uniform(0.3, 1.2))
        while _steps_done(run_dir) < 10:
            assert learner.poll() is None, learner.log_path.read_text()[-3000:]
            time.sleep(0.1)
        assert learner.poll() is None, "the run ended before the chaos did; raise STEPS"
        if event == "actor":
            victim = rng.randrange(len(actors))
            actors[victim].send_signal(signal.SIGKILL)
            actors[victim].wait()
            actors[victim] = start_actor(victim)
            actor_kills += 1
        else:
            learner.send_signal(signal.SIGKILL)
            learner.wait()
            learner = spawn("learner", "--resume", str(run_dir), name="learner-resumed")
            learner_kills += 1
    learner.wait(timeout=420)
    assert learner.returncode == 0, learner.log_path.read_text()[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "the run reaches its step target once"

    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    ids = [entry["group_id"] for entry in ledger]
    duplicates = len(ids) - len(set(ids))
    assert duplicates == 0

    checkpoint = latest_checkpoint(run_dir)
    state = read_state(checkpoint)["scheduler"]
    queued = {g for g, _ in state["requeued"]} | {g for lease in state["leases"] for g, _ in lease["tickets"]}
    handed_out = {f"g{serial:08d}" for serial in range(1, state["serial"] + 1)}
    lost = handed_out - set(ids) - queued
    assert lost == set(), f"{len(lost)} groups vanished"
    assert set(ids) == set(state["finished"])

    model, tokenizer = mlx_lm.load(str(checkpoint))
    assert isinstance(mlx_lm.generate(model, tokenizer, "123=", max_tokens=4), str)
    print(f"chaos: actor kills {actor_kills}, learner kills {learner_kills}, groups accepted {len(ids)}, "
          f"duplicates {duplicates}, lost {len(lost)}, handed out {len(handed_out)}")
