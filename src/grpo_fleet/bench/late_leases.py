"""Long answers and lease deadlines: how much work a fleet throws away when leases outlive their deadline.

A real learner process (bench/learner_process.py) leases to two simulated actors
whose time per group is lognormal around LEASE_SECONDS (answers of hundreds of
tokens, 10x spread), so most leases outlive their deadline. Like real actors,
they heartbeat while they "decode" (between decoding steps), and send no model's
work: made-up tokens that pass the learner's checks. The same fleet runs twice,
in one run of this benchmark:

* extended: the default; a lease past its deadline whose actor still
  heartbeats gets another lease_seconds, up to server.max_lease_seconds;
* not extended: server.max_lease_seconds = lease_seconds, so every lease past
  its deadline is re-queued (and may be done twice).

Both keep late results (a result for an expired lease counts for the groups
nobody finished meanwhile). Figure: groups sent but not accepted (duplicates,
stale), per 100 sent; before issue 38 every late result was refused as
`stale_lease`.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.learner_process import start_learner, stop_learner, wait_serving
from grpo_fleet.bench.simulated_actor import completion_arrays, connect
from grpo_fleet.protocol import messages as m

if TYPE_CHECKING:
    from grpo_fleet.protocol.client import Client

LEASE_SECONDS = 2.0
HEARTBEAT_SECONDS = 0.5
MEDIAN_SECONDS_PER_GROUP = 1.5  # lognormal, sigma 0.7: 10x between its 5th and 95th percentiles
SIGMA = 0.7
ACTORS = 2
REQUEST_TIMEOUT_S = 15.0


def _overrides(extended: bool) -> dict:
    return {"server": {"lease_seconds": LEASE_SECONDS, "heartbeat_seconds": HEARTBEAT_SECONDS,
                       "max_groups_per_lease": 4, "max_lease_seconds": None if extended else LEASE_SECONDS}}


def _groups(welcome: m.Welcome, seed: int) -> list[list[m.Completion]]:
    rng = np.random.default_rng(seed)
    gen = welcome.generation
    return [[m.Completion(tokens=m.Tensor.from_numpy(t), logprobs=m.Tensor.from_numpy(lp), reward=r,
                          finish_reason="length")
             for t, lp, r in completion_arrays(welcome.vocab_size, gen.group_size, gen.max_tokens, rng)]
            for _ in range(4)]


def _decode(client: Client, name: str, seconds: float) -> None:
    """Stand in for decoding for `seconds`, heartbeating between 'steps' as a real actor does."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(HEARTBEAT_SECONDS / 2, left))
        client.request(m.Heartbeat(actor_id=name, policy_version=0, sent_at=time.time()), REQUEST_TIMEOUT_S)


def long_answer_actor(endpoint: str, name: str, seed: int, end: float, out: dict) -> None:
    """One simulated actor until `end`: lease, decode (lognormal time per group), submit; counts each group's answer."""
    client = connect({"endpoint": endpoint, "identity": name, "curve": None})
    rng = np.random.default_rng(seed)
    try:
        welcome = client.request(m.Hello(actor_id=name, host="bench", backend="simulated", versions={}),
                                 REQUEST_TIMEOUT_S)
        assert isinstance(welcome, m.Welcome), welcome
        groups = _groups(welcome, seed)
        while time.time() < end:
            lease = client.request(m.LeaseRequest(max_groups=4), REQUEST_TIMEOUT_S)
            if not isinstance(lease, m.Lease) or not lease.prompts:
                time.sleep(getattr(lease, "retry_after", 0.1))
                continue
            _decode(client, name, float(rng.lognormal(np.log(MEDIAN_SECONDS_PER_GROUP), SIGMA, len(lease.prompts)).sum()))
            ack = client.request(m.Rollouts(
                lease_id=lease.lease_id, policy_version=lease.policy_version, incarnation=welcome.incarnation,
                groups=[m.GroupResult(group_id=p.group_id, completions=groups[i % len(groups)])
                        for i, p in enumerate(lease.prompts)]), REQUEST_TIMEOUT_S)
            for status in getattr(ack, "groups", {}).values():
                out[status] = out.get(status, 0) + 1
    except Exception as exc:  # reported by the phase
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        client.close()


def _phase(root: Path, extended: bool, window: float) -> dict[str, int]:
    """The fleet against a fresh learner for `window` seconds; each group's answer, counted over both actors."""
    learner = start_learner(root, "extended" if extended else "not-extended", overrides=_overrides(extended))
    try:
        wait_serving(learner)
        end = time.time() + window
        outs: list[dict] = [{} for _ in range(ACTORS)]
        threads = [threading.Thread(target=long_answer_actor, args=(learner.endpoint, f"long{i}", i, end, outs[i]))
                   for i in range(ACTORS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop_learner(learner)
    errors = [out["error"] for out in outs if "error" in out]
    if errors:
        raise RuntimeError(f"simulated actors failed: {errors}")
    return {key: sum(out.get(key, 0) for out in outs) for key in {k for out in outs for k in out}}


def _thrown_away(counts: dict[str, int]) -> float:
    sent = sum(counts.values())
    return 100.0 * (sent - counts.get("accepted", 0)) / sent if sent else float("nan")


def run(report: Report, scale: Scale) -> None:
    window = {Scale.QUICK: 20.0, Scale.DEFAULT: 40.0, Scale.FULL: 90.0}[scale]
    with tempfile.TemporaryDirectory(prefix="grpo-bench-late-") as tmp:
        extended = _phase(Path(tmp), True, window)
        fixed = _phase(Path(tmp), False, window)
    print("extended:", extended, "not extended:", fixed)
    setting = f"{ACTORS} actors, {MEDIAN_SECONDS_PER_GROUP:g} s/group median (lognormal) vs {LEASE_SECONDS:g} s leases"
    report.add(Figure("late_leases", f"groups sent but not accepted per 100, {setting}", _thrown_away(extended), "%",
                      baseline=_thrown_away(fixed), baseline_name="leases never extended", goal="0",
                      notes=f"extended: {extended}; not extended: {fixed}"))
