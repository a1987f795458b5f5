"""A real learner and two real actors over TCP on 127.0.0.1."""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers import assert_checkpoint_generates_like_the_learner, audit_ledger, jsonl, scrape, wait_for, wait_steps

REQUIRED_KEYS = {
    "step", "policy_version", "reward_mean", "loss", "kl", "clip_fraction",
    "groups", "tokens", "staleness_mean", "step_seconds", "ratio_mean", "learning_rate",
}


# What both tests here share on top of the run_config defaults: longer completions,
# a smaller task and leases long enough that no lease expires in a healthy run.
FLEET = {
    "generation": {"max_tokens": 5},
    "task": {"num_train": 100},
    "grpo": {"beta": 0.04},
    "server": {"lease_seconds": 20.0},
}


def test_learner_and_two_actors_train_over_tcp(run_config, free_port, spawn):
    ports = {"learner": free_port(), "actor0": free_port(), "actor1": free_port()}
    config, cfg = run_config(**FLEET, train={"steps": 12, "sync_every": 2, "checkpoint_every": 5, "log_samples_every": 1},
                             metrics={"port": ports["learner"]})
    run_dir = Path(cfg.run_dir)
    # Actors first, up and knocking before the learner binds (protocol/sockets.py): an actor that started
    # after a 12-step run had ended would wait for a learner that is gone, as it must (it cannot tell "done" from
    # "not up yet"), and this test once lost that race on a loaded host.
    actors = [
        spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"it-{i}", "--metrics-port", str(ports[f"actor{i}"]),
              "--model-dir", str(run_dir), name=f"actor{i}")
        for i in range(2)
    ]
    pages = {f"actor{i}": wait_for(lambda port=ports[f"actor{i}"]: scrape(port, 2).text, f"actor{i}'s /metrics", 90,
                                   actors) for i in range(2)}
    # Long enough for their reconnect backoff to reach its ceiling: each must still knock again, and join, within
    # RECONNECT_MAX_MS of the learner binding. With a 5 s ceiling the 12-step run (~4 s) once ended first.
    time.sleep(6.5)
    learner = spawn("learner", "--config", str(config), name="learner")
    # Scraped while the run is live.
    pages.update({name: wait_for(lambda port=port: scrape(port, 2).text, f"{name}'s /metrics", 90, [learner, *actors])
                  for name, port in ports.items()})
    assert set(pages) == set(ports), f"no /metrics from {set(ports) - set(pages)}"
    assert "grpo_fleet_learner_steps_total" in pages["learner"]
    assert all("grpo_fleet_actor_groups_generated_total" in pages[f"actor{i}"] for i in range(2))

    assert learner.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
    assert all(f"actor it-{i} joined" in learner.log_path.read_text() for i in range(2)), learner.log_path.read_text()
    for actor in actors:
        assert actor.wait(timeout=30) == 0, "actors stop cleanly on the learner's Shutdown"
    # Each actor that heard the end on PUB answered it, so the learner did not linger its grace out waiting.
    assert "not heard from within" not in learner.log_path.read_text(), learner.log_path.read_text()[-2000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(REQUIRED_KEYS <= set(r) for r in records)
    assert records[-1]["policy_version"] == 6
    assert all(r["groups"] == 2 and r["tokens"] > 0 for r in records)

    ledger = jsonl(run_dir / "ledger.jsonl")
    audit = audit_ledger(run_dir / "ledger.jsonl")  # each group accepted once, and dropped at most once after that
    assert len(audit.accepted) >= 24
    assert {entry["actor_id"] for entry in ledger} <= {"it-0", "it-1"}

    samples = jsonl(run_dir / "samples.jsonl")
    assert [row["step"] for row in samples] == [step for step in range(1, 13) for _ in range(4)], "4 rows a step"
    assert {row["group_id"] for row in samples} <= audit.trained and {row["actor_id"] for row in samples} <= {"it-0", "it-1"}
    assert all(row["policy_version"] < row["step"] and row["completion"] and row["prompt"] for row in samples)

    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == 12
    assert_checkpoint_generates_like_the_learner(run_dir / "checkpoints" / pointer["path"], "123=", max_tokens=4)


def test_sigterm_checkpoints_and_resume_continues_the_run(run_config, spawn):
    import signal

    # Steps and checkpoint cadence far out of reach: the run only stops, and only
    # checkpoints, because of the SIGTERM.
    config, cfg = run_config(**FLEET, train={"steps": 100000, "sync_every": 2, "checkpoint_every": 100000,
                                             "log_samples_every": 1})
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actors = [spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"t-{i}", "--metrics-port", "0",
                    "--request-timeout", "3", "--model-dir", str(run_dir), name=f"a{i}")
              for i in range(2)]
    wait_steps(run_dir, 5, learner)

    actors[1].send_signal(signal.SIGTERM)
    assert actors[1].wait(timeout=20) == 0, "an actor drains and exits on SIGTERM"
    learner.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert learner.wait(timeout=30) == 0
    assert time.monotonic() - started < 30
    stopped_at = len(jsonl(run_dir / "metrics.jsonl"))
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == stopped_at, "SIGTERM writes a checkpoint of the last step"

    target = stopped_at + 4
    resumed = spawn("learner", "--resume", str(run_dir), "--set", f"train.steps={target}", name="resumed")
    assert resumed.wait(timeout=180) == 0, resumed.log_path.read_text()[-3000:]
    assert actors[0].wait(timeout=30) == 0, "the surviving actor reconnected, worked and was told to stop"
    assert [r["step"] for r in jsonl(run_dir / "metrics.jsonl")] == list(range(1, target + 1))
    audit_ledger(run_dir / "ledger.jsonl")  # each group accepted once, and dropped at most once after that
    assert [row["step"] for row in jsonl(run_dir / "samples.jsonl")] == [s for s in range(1, target + 1) for _ in range(4)]


def test_an_actor_asked_to_stop_before_any_learner_answers_stops_at_once(free_port, spawn):
    import signal

    # Nothing listens on the learner's port: the actor's Hello waits for an answer (up to its
    # 30 s request timeout) that never comes. With nothing in hand to deliver, SIGTERM ends the wait.
    metrics = free_port()
    actor = spawn("actor", "--connect", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(metrics), name="alone")
    wait_for(lambda: scrape(metrics), "the actor's /metrics (served just before it says Hello)", procs=[actor])
    time.sleep(1.0)
    actor.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert actor.wait(timeout=30) == 0
    assert time.monotonic() - started < 5, actor.log_path.read_text()
    assert "asked to stop while waiting for the learner's answer to Hello" in actor.log_path.read_text()


def test_a_second_sigterm_stops_an_actor_still_draining_to_a_dead_learner(run_config, spawn):
    import signal

    config, cfg = run_config(train={"steps": 1000})
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--model-dir", str(cfg.run_dir), name="actor")
    wait_steps(Path(cfg.run_dir), 2, learner)
    learner.kill()  # gone for good: the actor's next lease and its rollouts can never be acknowledged
    learner.wait()
    # Past any refused lease's retry_after (0.2 s at most), so the actor holds a request the learner never answers:
    # signalled during that wait with nothing in hand, it rightly stops at once.
    time.sleep(1.0)
    actor.send_signal(signal.SIGTERM)
    time.sleep(2.0)
    assert actor.poll() is None, "the first SIGTERM drains: the leased work waits for the learner"
    actor.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert actor.wait(timeout=30) == 0, actor.log_path.read_text()[-3000:]
    assert time.monotonic() - started < 5, "the second SIGTERM stops at once, not after the 30 s request timeout"
    assert "a second stop signal" in actor.log_path.read_text()
