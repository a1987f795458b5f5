"""A real learner process for the benchmarks that drive one with simulated actors (ingest, hostile, mixed).

It never trains (its buffer grows without bound and never throttles leases), and
it re-scores nothing: simulated actors send made-up tokens and rewards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.bench.simulated_actor import session
from grpo_fleet.protocol.endpoints import loopback_endpoint

# Shapes of the simulated work: G completions of MAX_TOKENS tokens per group,
# GROUPS_PER_LEASE groups per Rollouts message (about 33 KB of tensors each).
GROUP_SIZE = 8
MAX_TOKENS = 128
# The ingest learner must never train: the buffer can then grow without bound
# and `_lease_capacity` (2 * groups_per_step) never throttles leases.
NEVER_TRAIN_GROUPS = 10**9
START_TIMEOUT_S = 180.0


@dataclass
class LearnerProcess:
    """One learner subprocess and how to reach it."""

    proc: subprocess.Popen
    endpoint: str
    run_dir: Path
    log_path: Path
    keys: Optional[Path] = None  # CURVE keys directory when CURVE is on



def learner_config(run_dir: Path, keys: Optional[Path]) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir),
        "model": {"path": "tiny"},
        "generation": {"group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS},
        "grpo": {"groups_per_step": NEVER_TRAIN_GROUPS},
        "server": {
            "bind": loopback_endpoint(),
            "pub_bind": loopback_endpoint(),
            "max_groups_per_lease": 256,
            # A bug in the simulated actors should show up as counted rejections, not a ban.
            "max_violations": 10**9,
        },
        # Simulated actors send made-up tokens and rewards: these figures are the plumbing's, without the
        # learner's re-scoring and logprob checks (security.verify_*), which real actors' groups pass.
        "security": {"keys_dir": str(keys) if keys else None, "verify_rewards": False, "verify_logprobs": False},
        "metrics": {"port": 0},
    }


def start_learner(root: Path, name: str, keys: Optional[Path] = None, overrides: Optional[dict] = None) -> LearnerProcess:
    """A real learner process; `overrides` replaces keys of the ingest config's sections."""
    from grpo_fleet.runtime.blas import child_env

    data = learner_config(root / name, keys)
    for section, values in (overrides or {}).items():
        data[section] = {**data.get(section, {}), **values}
    config = root / f"{name}.json"
    config.write_text(json.dumps(data))
    log_path = root / f"{name}.log"
    with open(log_path, "w") as log:
        # Own session, so the kill in `stop_learner` reaches anything it starts.
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_fleet", "learner", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True,
        )
    return LearnerProcess(proc, data["server"]["bind"], root / name, log_path, keys)


def stop_learner(learner: LearnerProcess) -> None:
    # SIGKILL, not SIGTERM: a stop would checkpoint the huge untrained buffer.
    if learner.proc.poll() is None:
        try:
            os.killpg(learner.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    learner.proc.wait()


def curve_for(learner: LearnerProcess, index: int) -> Optional[tuple[str, str]]:
    """(actor secret key file, learner public key file) for actor `index`, or None when plain."""
    if learner.keys is None:
        return None
    return str(learner.keys / "actors" / f"bench{index}.key_secret"), str(learner.keys / "learner.key")


def wait_serving(learner: LearnerProcess) -> None:
    """Block until the learner answers a Hello (it builds the tiny model first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if learner.proc.poll() is not None:
            raise RuntimeError(f"learner exited: {learner.log_path.read_text()[-2000:]}")
        job = {"endpoint": learner.endpoint, "identity": f"probe-{time.time_ns()}", "curve": curve_for(learner, 0)}
        out = session(job | {"start": 0.0, "end": 0.0}, timeout=2.0)
        if not out["errors"]:
            return
    raise RuntimeError(f"learner never answered: {learner.log_path.read_text()[-2000:]}")
