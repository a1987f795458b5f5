"""A simulated actor for the ingest benchmark: the wire protocol through `protocol.client`, no model.

It runs in its own spawned process and sends pre-built, valid completions, so
what the benchmark measures is the learner's side of the rollout path.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from grpo_fleet.protocol.client import Client

GROUPS_PER_LEASE = 4
REQUEST_TIMEOUT_S = 15.0


# The learner checks finish_reason against its end tokens, and a simulated actor knows no tokenizer: its
# "length" completions keep off the ids where tokenizers put their specials (a trained BPE's first ids, Qwen's
# from 151,643 on).
FIRST_PLAIN_ID, FIRST_QWEN_SPECIAL = 16, 151_643


def _plain_ids(vocab: int) -> tuple[int, int]:
    return min(FIRST_PLAIN_ID, vocab - 1), min(vocab, FIRST_QWEN_SPECIAL)


def completion_arrays(vocab: int, group_size: int, length: int, rng: np.random.Generator) -> list[tuple]:
    """(tokens, logprobs, reward) for one group: valid ids, negative logprobs, rewards that differ."""
    rewards = rng.permutation(np.linspace(0.0, 1.0, group_size))  # never all equal: informative
    return [
        (
            rng.integers(*_plain_ids(vocab), size=length, dtype=np.int32),
            -rng.uniform(0.01, 5.0, size=length).astype(np.float32),
            float(reward),
        )
        for reward in rewards
    ]


def _prebuilt_groups(vocab: int, group_size: int, length: int, seed: int, variants: int = 4) -> list[list]:
    """A few validated groups of `Completion`s, reused under new group ids so the loop only encodes."""
    from grpo_fleet.protocol import messages as m

    rng = np.random.default_rng(seed)
    return [
        [
            m.Completion(tokens=m.Tensor.from_numpy(t), logprobs=m.Tensor.from_numpy(lp), reward=r, finish_reason="length")
            for t, lp, r in completion_arrays(vocab, group_size, length, rng)
        ]
        for _ in range(variants)
    ]


def connect(job: dict, ctx: Any = None) -> "Client":
    """A client of the learner at job["endpoint"] as job["identity"], with CURVE when job["curve"] names key files."""
    from grpo_fleet.protocol.auth import client_curve
    from grpo_fleet.protocol.client import Client

    curve = client_curve(*job["curve"]) if job["curve"] is not None else None
    return Client(job["endpoint"], identity=job["identity"], curve=curve, ctx=ctx)


def timed_request(client: "Client", payload: bytes, timeout: float) -> tuple[Any, float]:
    """Send one encoded message, wait for the reply; returns (reply, seconds)."""
    sent = time.perf_counter()
    reply = client.request_encoded(payload, timeout)
    return reply, time.perf_counter() - sent


def _round(client: "Client", groups: list[list], job: dict, out: dict, timeout: float) -> None:
    """One LeaseRequest -> Lease -> Rollouts -> Ack cycle; counts it when the Ack lands in the window."""
    from grpo_fleet.protocol import messages as m
    from grpo_fleet.protocol.codec import encode

    lease, lease_s = timed_request(client, encode(m.LeaseRequest(max_groups=job.get("max_groups", GROUPS_PER_LEASE))), timeout)
    if not isinstance(lease, m.Lease) or not lease.prompts:
        out["empty_leases"] += 1
        time.sleep(getattr(lease, "retry_after", 0.1))
        return
    # Stands in for generating on another machine: takes time, not this machine's CPU.
    time.sleep(job.get("seconds_per_group", 0.0) * len(lease.prompts))
    results = [m.GroupResult(group_id=p.group_id, completions=groups[i % len(groups)]) for i, p in enumerate(lease.prompts)]
    payload = encode(m.Rollouts(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                incarnation=job["incarnation"], groups=results))
    ack, seconds = timed_request(client, payload, timeout)
    if not job["start"] <= time.time() <= job["end"]:
        return  # warm-up, or past the window: not measured
    accepted = isinstance(ack, m.Ack) and ack.status == "accepted" and set(ack.groups.values()) == {"accepted"}
    out["lease_sizes"].append(len(results))
    out["stale_groups"] += sum(status == "stale" for status in getattr(ack, "groups", {}).values())
    if not accepted:
        out["rejected"] += 1
        return
    out["latencies_ms"].append(seconds * 1000)
    out["lease_ms"].append(lease_s * 1000)
    out["groups"] += len(results)
    out["tokens"] += sum(c.tokens.shape[0] for g in results for c in g.completions)


def session(job: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """One simulated actor: Hello, then rounds until the window closes."""
    from grpo_fleet.protocol import messages as m
    from grpo_fleet.protocol.codec import encode

    out: dict = {"tokens": 0, "groups": 0, "latencies_ms": [], "lease_ms": [], "lease_sizes": [], "rejected": 0,
                 "stale_groups": 0, "empty_leases": 0, "errors": [], "identity": job["identity"]}
    client = connect(job)
    try:
        hello = m.Hello(actor_id=job["identity"], host="bench", backend="simulated", versions={})
        welcome, _ = timed_request(client, encode(hello), timeout)
        if not isinstance(welcome, m.Welcome):
            raise RuntimeError(f"expected Welcome, got {welcome!r}"[:300])
        gen = welcome.generation
        job = {**job, "incarnation": welcome.incarnation}
        groups = _prebuilt_groups(welcome.vocab_size, gen.group_size, gen.max_tokens, seed=zlib.crc32(job["identity"].encode()))
        while time.time() < job["end"]:
            _round(client, groups, job, out, timeout)
    except Exception as exc:  # reported to the parent, which fails the phase loudly
        out["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
    finally:
        client.close()
    return out


def pool_worker(commands: Any, results: Any) -> None:
    """Pool process: run one session per job until told to stop (None)."""
    results.put({"ready": os.getpid()})
    while True:
        job = commands.get()
        if job is None:
            return
        results.put(session(job))
