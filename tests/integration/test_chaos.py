"""Chaos: SIGKILL the learner at random points past its checkpoint, and actors at random
moments; the run keeps advancing, no honest actor is banned, nothing is lost or counted twice."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from grpo_fleet.learner.records.persistence import read_state
from grpo_fleet.models.loading import latest_checkpoint
from helpers import (
    assert_checkpoint_generates_like_the_learner,
    audit_ledger,
    finished_in_checkpoint,
    scrape,
    wait_for,
    wait_steps,
)

# The first learner's target is out of reach: the last resumed one is given the run's real end, a few
# checkpoints past the last kill, so the run ends soon after the chaos does, however fast it went.
STEPS = 400
CHECKPOINT_EVERY = 10
STEPS_AFTER_LAST_KILL = 2 * CHECKPOINT_EVERY
LEARNER_KILLS = 3
ACTOR_KILLS = 6
# After a resume the run must pass the step it died at within this long. A
# learner that refuses its actors' work (the livelock this test was written for)
# never does; a healthy one needs a few seconds to load plus a few steps.
RESUME_BOUND_SECONDS = 60.0
FREEZE_TRIES = 10


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _checkpointed_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest.json"
    return json.loads(latest.read_text())["step"] if latest.exists() else 0


def _late_work_handled(metrics_port: int) -> float:
    """Late groups taken (issue 38), or refused as stale_lease (a lease no longer remembered)."""
    scraped = scrape(metrics_port)
    return (scraped.value("grpo_fleet_learner_late_groups_total", kind="train")
            + scraped.value("grpo_fleet_learner_rejections_total", reason="stale_lease"))


def _freeze_past_lease(actors: list, learner, metrics_port: int, lease_seconds: float) -> int:
    """SIGSTOP every actor past its lease (Macs asleep), then SIGCONT, until late work has come back; returns the tries.

    With all of them frozen the learner cannot step past what it had buffered
    (server.in_flight_steps), so the late work is from a version it can still
    train: it reaches the reward check (security.verify_rewards, the default),
    and must be taken as late work (or refused as stale_lease), not answered
    `internal` with a traceback. A frozen actor sends no heartbeat, so its leases
    are not extended. An actor frozen while it held no lease (the learner's
    capacity was full) has nothing late to send, hence the tries.
    """
    before = _late_work_handled(metrics_port)

    def handled() -> bool:
        assert "error handling" not in learner.log_path.read_text(), learner.log_path.read_text()[-3000:]
        return _late_work_handled(metrics_port) > before

    for tries in range(1, FREEZE_TRIES + 1):
        for actor in actors:
            actor.send_signal(signal.SIGSTOP)
        # Past the lease, but short of the learner's silence limit (10 heartbeats): the actors stay registered.
        time.sleep(lease_seconds + 0.75)
        for actor in actors:
            actor.send_signal(signal.SIGCONT)
        try:
            wait_for(handled, "late submissions taken or refused as stale_lease", timeout=5, procs=[learner])
            return tries
        except AssertionError as failed:
            if "timed out" not in str(failed):
                raise
    raise AssertionError(f"no late submission reached the learner in {FREEZE_TRIES} freezes")


def _wait_for_offset(run_dir: Path, learner, offset: int, at_least: int) -> int:
    """Poll until the run is `offset` steps past a checkpoint (and past `at_least`); returns the step."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-3000:]
        done = _steps_done(run_dir)
        if done >= at_least and done % CHECKPOINT_EVERY == offset and _checkpointed_step(run_dir) == done - offset:
            return done
        time.sleep(0.002)
    raise AssertionError(f"the run never reached {offset} steps past a checkpoint")


def _wait_for_progress(run_dir: Path, learner, beyond: int) -> float:
    """Seconds until the resumed run passes step `beyond`; fails past RESUME_BOUND_SECONDS."""
    started = time.monotonic()
    while time.monotonic() - started < RESUME_BOUND_SECONDS:
        assert learner.poll() is None, learner.log_path.read_text()[-3000:]
        if _steps_done(run_dir) > beyond:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(
        f"stuck after resume: still at step {_steps_done(run_dir)} of the {beyond} it died at, "
        f"{RESUME_BOUND_SECONDS:.0f}s later\n" + learner.log_path.read_text()[-3000:]
    )


@pytest.mark.slow
def test_fleet_survives_sigkills_without_losing_or_duplicating_groups(run_config, spawn, free_port):
    # Short leases and heartbeats so killed actors' work is re-queued within the test.
    metrics_port = free_port()
    config, cfg = run_config(
        metrics={"port": metrics_port},
        task={"num_train": 300},
        train={"steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY},
        server={"lease_seconds": 3.0, "heartbeat_seconds": 0.5, "max_groups_per_lease": 2, "max_violations": 5},
    )
    run_dir, bind = Path(cfg.run_dir), cfg.server.bind
    rng = random.Random(20261201)

    def start_actor(index: int):
        return spawn("actor", "--connect", bind, "--actor-id", f"chaos-{index}", "--metrics-port", "0",
                     "--request-timeout", "3", "--model-dir", str(run_dir), name=f"actor{index}")

    learners = [spawn("learner", "--config", str(config), name="learner")]
    actors = [start_actor(i) for i in range(3)]
    wait_steps(run_dir, 2, learners[-1])  # the fleet is at work: its actors hold leases to overrun
    freezes = _freeze_past_lease(actors, learners[-1], metrics_port, cfg.server.lease_seconds)
    for _ in range(ACTOR_KILLS):
        time.sleep(rng.uniform(0.3, 1.2))
        assert learners[-1].poll() is None, learners[-1].log_path.read_text()[-3000:]
        victim = rng.randrange(len(actors))
        actors[victim].send_signal(signal.SIGKILL)
        actors[victim].wait()
        actors[victim] = start_actor(victim)
    # Every resume point past a checkpoint is equally likely; 0 (right after one) included.
    offsets = rng.sample(range(CHECKPOINT_EVERY), LEARNER_KILLS)
    recoveries, target = [], STEPS
    for kill, offset in enumerate(offsets, start=1):
        # The same actors throughout: they hold versions newer than the checkpoint.
        died_at = _wait_for_offset(run_dir, learners[-1], offset, at_least=_steps_done(run_dir) + CHECKPOINT_EVERY)
        learners[-1].send_signal(signal.SIGKILL)
        learners[-1].wait()
        resume = ["learner", "--resume", str(run_dir)]
        if kill == LEARNER_KILLS:
            target = died_at + STEPS_AFTER_LAST_KILL
            resume += ["--set", f"train.steps={target}"]
        learners.append(spawn(*resume, name="learner-resumed"))
        recoveries.append(_wait_for_progress(run_dir, learners[-1], beyond=died_at))
    learner = learners[-1]
    learner.wait(timeout=420)
    assert learner.returncode == 0, learner.log_path.read_text()[-3000:]

    learner_logs = "".join(proc.log_path.read_text() for proc in learners)
    assert " banned " not in learner_logs, "an honest actor was banned"
    assert "error handling" not in learner_logs, "a request raised in the learner"
    for proc in actors:
        assert "learner rejected lease" not in proc.log_path.read_text(), "an honest actor's work was refused as invalid"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, target + 1)), "the run reaches its step target once"

    audit = audit_ledger(run_dir / "ledger.jsonl")  # each group accepted once, dropped at most once after that
    ids, duplicates = audit.accepted, 0

    checkpoint = latest_checkpoint(run_dir)
    state = read_state(checkpoint)["scheduler"]
    queued = {g for g, _ in state["requeued"]} | {g for lease in state["leases"] for g, _ in lease["tickets"]}
    handed_out = {f"g{serial:08d}" for serial in range(1, state["serial"] + 1)}
    lost = handed_out - set(ids) - queued
    assert lost == set(), f"{len(lost)} groups vanished"
    assert set(ids) == finished_in_checkpoint(state)
    retried = {drop["retried_as"] for drop in audit.dropped.values()}
    assert retried <= handed_out, "a dropped group's prompt was queued again as a new group"

    assert_checkpoint_generates_like_the_learner(checkpoint, "123=", max_tokens=4)
    print(f"chaos: learner kills at {offsets} steps past a checkpoint, back past the kill in "
          f"{', '.join(f'{s:.1f}s' for s in recoveries)}; actor kills {ACTOR_KILLS}, groups accepted {len(ids)}, "
          f"freezes until late work came back {freezes}, dropped {len(audit.dropped)}, duplicates {duplicates}, "
          f"lost {len(lost)}, handed out {len(handed_out)}")
