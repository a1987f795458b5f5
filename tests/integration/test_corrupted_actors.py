"""Actors that lie (tests/liars/corrupt_actor.py) are caught within one lease; nothing of theirs trains; honest ones go on."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from helpers import audit_ledger, jsonl, scrape, wait_for

KINDS = ("rewards", "logprobs", "weights", "version")
# The run's target is out of reach: it ends on SIGTERM once the honest fleet has trained this many steps past the
# last ban, whenever the bans came (a fixed target would have to guess that, with a wide margin).
STEPS_AFTER_LAST_BAN = 20
LIAR = Path(__file__).resolve().parents[1] / "liars" / "corrupt_actor.py"


@pytest.mark.slow
def test_each_kind_of_corrupted_actor_is_caught_and_never_trained(run_config, spawn, free_port):
    port = free_port()
    config, cfg = run_config(
        train={"steps": 100000, "checkpoint_every": 100000, "log_samples_every": 1, "log_samples_count": 256},
        optim={"lr": 1e-3},  # the policy moves fast, so an actor stuck at version 0 is far from what it claims
        metrics={"port": port},
        server={"max_groups_per_lease": 2},
    )
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actor_args = ["--connect", cfg.server.bind, "--metrics-port", "0", "--model-dir", str(run_dir), "--max-groups", "2"]
    for i in range(2):
        spawn("actor", *actor_args, "--actor-id", f"honest-{i}", name=f"honest-{i}")
    # The version liar joins once the policy has moved; the others at once.
    wait_for(lambda: len([r for r in jsonl(run_dir / "metrics.jsonl") if "event" not in r]) >= 8,
             "8 honest steps", procs=[learner])
    for kind in KINDS:
        spawn(kind, *actor_args, "--actor-id", f"liar-{kind}", name=f"liar-{kind}", script=LIAR)

    def rejected() -> dict:
        samples = scrape(port).by_label("reason")
        return {reason: value for (name, reason), value in samples.items() if name == "grpo_fleet_learner_rejections_total"}

    def logprob_bans() -> set[str]:
        return set(re.findall(r"actor (liar-\w+): group \S+ \(claimed v\d+\) has logprobs", learner.log_path.read_text()))

    # The rejection count grows by every buffered group a ban drops, so wait for the bans themselves: each is
    # logged after its over-bound gap was observed, so the histogram below holds all three.
    wait_for(lambda: rejected().get("reward_mismatch", 0) > 0 and len(logprob_bans()) >= 3,
             "the liars to be caught", procs=[learner], timeout=180)
    buckets = {le: value for (name, le), value in scrape(port).by_label("le").items()
               if name == "grpo_fleet_learner_logprob_gap_nats_bucket"}
    # The honest groups' checks fall within the float32 actors' bound (1e-3 nats); those beyond it are counted
    # against the liars' groups below. (A liar's gap may be small: perturbed weights once gave 0.0043 nats.)
    assert buckets["0.001"] > 20, buckets
    over_threshold = buckets["+Inf"] - buckets["0.001"]
    bans = _bans(learner.log_path.read_text())
    assert set(bans) == {"liar-logprobs", "liar-weights", "liar-version"}, learner.log_path.read_text()[-3000:]
    honest_end = max(step for _, step in bans.values()) + STEPS_AFTER_LAST_BAN
    wait_for(lambda: len([r for r in jsonl(run_dir / "metrics.jsonl") if "event" not in r]) >= honest_end,
             f"the honest fleet to train {STEPS_AFTER_LAST_BAN} steps past the last ban", procs=[learner])
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=60) == 0, learner.log_path.read_text()[-3000:]

    log = learner.log_path.read_text()
    assert _bans(log) == bans, "each liar is banned once"
    assert over_threshold >= len(bans), "each ban is a check over the bound (honest ones stay under 1e-3, above)"
    audit = audit_ledger(run_dir / "ledger.jsonl")  # each group accepted once, dropped at most once after that
    ledger = [e for e in jsonl(run_dir / "ledger.jsonl") if "event" not in e]
    accepted = {kind: [e for e in ledger if e["actor_id"] == f"liar-{kind}"] for kind in KINDS}
    # Zero-variance groups are never trained, so never checked: only the liars' other groups could be.
    checkable = sum(not e["zero_variance"] for entries in accepted.values() for e in entries)
    assert over_threshold <= checkable, "every check over the honest bound was a liar's group"
    assert accepted["rewards"] == [], "every group is re-scored: none with altered rewards is accepted"
    for kind in ("logprobs", "weights", "version"):
        group, step = bans[f"liar-{kind}"]
        assert all(e["step"] <= step for e in accepted[kind]), f"{kind}: a group was accepted after the ban"
        # The group that failed its check was one it had been credited for.
        assert group in {e["group_id"] for e in accepted[kind]}
        # ... and the ledger says it, with every other buffered group of the liar, was dropped untrained.
        assert audit.dropped[group]["reason"] == "logprob_mismatch" and audit.dropped[group]["step"] == step
    assert {d["actor_id"] for d in audit.dropped.values() if d["reason"] == "logprob_mismatch"} <= {
        "liar-logprobs", "liar-weights", "liar-version"}, "only liars' groups are dropped for their logprobs"
    trained_by = {row["actor_id"] for row in jsonl(run_dir / "samples.jsonl")}
    assert trained_by <= {"honest-0", "honest-1"}, f"a liar's group was trained: {trained_by}"
    steps = [r["step"] for r in jsonl(run_dir / "metrics.jsonl") if "event" not in r]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= honest_end, "the honest fleet trained on"
    assert "honest" not in " ".join(re.findall(r"actor (\S+) reported rewards", log)), "no honest false rejection"


def _bans(log: str) -> dict[str, tuple[str, int]]:
    """Each banned liar's failed group and the step it was banned after, from the learner's log."""
    return {actor: (group, int(step)) for actor, group, step in re.findall(
        r"actor (liar-\w+): group (\S+) \(claimed v\d+\) has logprobs .* banned after step (\d+)", log)}
