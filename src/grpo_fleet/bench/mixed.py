"""Capacity-based leasing: a fleet of unequal Macs, leases sized by speed against fixed leases.

A real learner process trains the tiny model on rollouts from two simulated
actors (bench/simulated_actor.py) that differ only in speed: each sleeps a fixed
time per group before it answers, which stands in for generating on its own
machine without using this one's CPU. The slow one is SLOWDOWN times slower.
The same fleet runs twice, in one run of this benchmark:

* sized: the default; each lease is sized from the actor's measured groups/s to
  come back within max_staleness learner steps;
* fixed: every lease is what the actor asks for (as before capacity sizing),
  i.e. `server.lease_target_seconds` so long that speed never limits a lease.

Figures: learner steps/s, and how many groups came back too stale to use.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.ingest import ActorPool
from grpo_fleet.bench.learner_process import START_TIMEOUT_S, start_learner, stop_learner, wait_serving

FAST_SECONDS_PER_GROUP = 0.005
SLOWDOWN = 10
GROUPS_PER_STEP = 8
LEASE_SECONDS = 60.0


def _overrides(sized: bool) -> dict:
    return {
        "generation": {"group_size": 8, "max_tokens": 5},
        "grpo": {"groups_per_step": GROUPS_PER_STEP, "beta": 0.04},
        "train": {"steps": 10**6, "checkpoint_every": 10**6},
        "server": {"max_groups_per_lease": GROUPS_PER_STEP, "lease_seconds": LEASE_SECONDS,
                   "lease_target_seconds": None if sized else LEASE_SECONDS},
    }


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for _ in path.open()) if path.exists() else 0


def _phase(pool: ActorPool, root: Path, sized: bool, warmup: float, window: float) -> dict:
    """One fleet (fast + slow actor) against a fresh learner; what happened in the window."""
    name = "sized" if sized else "fixed"
    learner = start_learner(root, name, overrides=_overrides(sized))
    try:
        wait_serving(learner)
        start = time.time() + warmup
        end = start + window
        speeds = {"fast": FAST_SECONDS_PER_GROUP, "slow": FAST_SECONDS_PER_GROUP * SLOWDOWN}
        for label, seconds in speeds.items():
            pool.commands.put({"endpoint": learner.endpoint, "identity": f"{name}-{label}", "curve": None,
                               "start": start, "end": end, "seconds_per_group": seconds,
                               "max_groups": GROUPS_PER_STEP})
        time.sleep(max(0.0, start - time.time()))
        steps_before = _steps_done(learner.run_dir)
        time.sleep(max(0.0, end - time.time()))
        steps = _steps_done(learner.run_dir) - steps_before
        results = [pool.get(timeout=START_TIMEOUT_S + window) for _ in speeds]
    finally:
        stop_learner(learner)
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise RuntimeError(f"simulated actors failed: {errors[:3]}")
    by_actor = {r["identity"].rsplit("-", 1)[1]: r for r in results}
    return {"steps_per_s": steps / window, "actors": by_actor}


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summary(phase: dict) -> str:
    parts = []
    for label, r in sorted(phase["actors"].items()):
        parts.append(f"{label}: {r['groups']} groups accepted, {r['stale_groups']} stale, "
                     f"mean lease {_mean(r['lease_sizes']):.1f}")
    return "; ".join(parts)


def run(report: Report, scale: Scale) -> None:
    warmup, window = {Scale.QUICK: (2.0, 6.0), Scale.DEFAULT: (2.0, 10.0), Scale.FULL: (3.0, 15.0)}[scale]
    with tempfile.TemporaryDirectory(prefix="grpo-bench-mixed-") as tmp:
        pool = ActorPool(2)
        try:
            sized = _phase(pool, Path(tmp), True, warmup, window)
            fixed = _phase(pool, Path(tmp), False, warmup, window)
        finally:
            pool.close()
    print("sized:", json.dumps({k: v for k, v in sized.items() if k != "actors"}), _summary(sized))
    print("fixed:", json.dumps({k: v for k, v in fixed.items() if k != "actors"}), _summary(fixed))
    setting = f"fast actor + one {SLOWDOWN}x slower"
    report.add(Figure("mixed", f"learner steps/s, {setting}, leases sized by speed", sized["steps_per_s"], "steps/s",
                      baseline=fixed["steps_per_s"], baseline_name="fixed leases",
                      notes=f"sized: {_summary(sized)}. fixed: {_summary(fixed)}"))
    for label in ("slow", "fast"):
        report.add(Figure("mixed", f"{label} actor's groups that came back stale, per 100 leased ({setting})",
                          _stale_share(sized, label), "%", baseline=_stale_share(fixed, label),
                          baseline_name="fixed leases"))


def _stale_share(phase: dict, label: str) -> float:
    r = phase["actors"][label]
    handed = r["groups"] + r["stale_groups"]
    return 100.0 * r["stale_groups"] / handed if handed else float("nan")
