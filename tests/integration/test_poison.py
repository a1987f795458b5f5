"""Schema-valid but poisoned groups over the real wire: refused, counted, and training goes on finite."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import zmq

from grpo_fleet.models.loading import latest_checkpoint
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode
from grpo_fleet.protocol.reasons import RejectReason
from helpers import scrape

STEPS = 20
# (label, reward, logprob, the reason the learner must give)
POISON = [
    ("reward 1e39: finite float64, inf float32", 1e39, -1.0, RejectReason.BAD_REWARD),
    ("reward -1e39", -1e39, -1.0, RejectReason.BAD_REWARD),
    ("reward past task.reward_bound", 2e4, -1.0, RejectReason.BAD_REWARD),
    ("reward nan", float("nan"), -1.0, RejectReason.BAD_REWARD),
    ("reward inf", float("inf"), -1.0, RejectReason.BAD_REWARD),
    ("logprob -3e38", 0.0, -3e38, RejectReason.BAD_LOGPROB),
    ("logprob below the floor", 0.0, -2e4, RejectReason.BAD_LOGPROB),
    ("logprob nan", 0.0, float("nan"), RejectReason.BAD_LOGPROB),
    ("logprob -inf", 0.0, float("-inf"), RejectReason.BAD_LOGPROB),
    ("logprob positive", 0.0, 0.5, RejectReason.BAD_LOGPROB),
]


def _request(sock: zmq.Socket, msg: object) -> object:
    sock.send(encode(msg))
    assert sock.poll(30_000), f"no answer to {type(msg).__name__}"
    return decode(sock.recv_multipart()[0])


def _poisoned(lease: m.Lease, group_size: int, reward: float, logprob: float) -> m.Rollouts:
    """One completion per group carries the poison; model_construct lets NaN and inf past our own validators."""
    def completion(value: float, lp: float) -> m.Completion:
        return m.Completion.model_construct(
            tokens=m.Tensor.from_numpy(np.array([3, 4, 5], dtype=np.int32)),
            logprobs=m.Tensor.from_numpy(np.full(3, lp, dtype=np.float32)),
            reward=value, finish_reason="length",
        )
    groups = [m.GroupResult.model_construct(group_id=p.group_id,
                            completions=[completion(reward, logprob)]
                            + [completion(float(i), -1.0) for i in range(1, group_size)])
              for p in lease.prompts]
    return m.Rollouts.model_construct(lease_id=lease.lease_id, policy_version=lease.policy_version, incarnation="",
                                      groups=groups)


def _wait_until_serving(sock: zmq.Socket, learner) -> m.Welcome:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-2000:]
        sock.send(encode(m.Hello(actor_id="poisoner", host="h", backend="cpu", versions={})))
        if sock.poll(500):
            reply = decode(sock.recv_multipart()[0])
            while sock.poll(300):  # answers to earlier probes
                reply = decode(sock.recv_multipart()[0])
            assert isinstance(reply, m.Welcome)
            return reply
    raise AssertionError("learner never answered")


def _assert_finite_checkpoint(run_dir: Path) -> None:
    checkpoint = latest_checkpoint(run_dir)
    for path in checkpoint.glob("*.safetensors"):
        for name, array in mx.load(str(path)).items():
            assert bool(mx.all(mx.isfinite(array.astype(mx.float32))).item()), f"{path.name}:{name} is not finite"


def _send_poison(sock: zmq.Socket, group_size: int) -> Counter[tuple[str, str]]:
    """Each poisoned value on a real lease; asserts each is refused, returns the counts the metrics must show."""
    expected: Counter[tuple[str, str]] = Counter()
    for label, reward, logprob, reason in POISON:
        lease = _request(sock, m.LeaseRequest(max_groups=1))
        while isinstance(lease, m.Lease) and not lease.prompts:
            time.sleep(lease.retry_after)
            lease = _request(sock, m.LeaseRequest(max_groups=1))
        ack = _request(sock, _poisoned(lease, group_size, reward, logprob))
        assert isinstance(ack, (m.Ack, m.ErrorReply)), label
        refused = ack.status == "invalid" if isinstance(ack, m.Ack) else ack.reason == "invalid"
        assert refused, f"{label}: {ack!r}"
        if isinstance(ack, m.Ack):
            assert ack.reason.split(":")[0] == reason, f"{label}: {ack.reason}"
            expected[("grpo_fleet_learner_rejections_total", reason)] += 1
        else:  # NaN and inf never get past decoding
            expected[("grpo_fleet_learner_protocol_errors_total", "invalid")] += 1
    return expected


@pytest.mark.slow
def test_poisoned_groups_are_refused_and_training_stays_finite(run_config, free_port, spawn, peer_socket):
    config, cfg = run_config(
        train={"steps": STEPS, "checkpoint_every": 1000},
        # Short leases: the poisoner's refused leases go back to the honest actor soon.
        server={"lease_seconds": 2.0, "heartbeat_seconds": 0.5, "max_violations": 1000},
        metrics={"port": free_port()},
    )
    run_dir, group_size = Path(cfg.run_dir), cfg.generation.group_size
    learner = spawn("learner", "--config", str(config), name="learner")
    sock = peer_socket(cfg.server.bind, b"poisoner")
    _wait_until_serving(sock, learner)
    spawn("actor", "--connect", cfg.server.bind, "--actor-id", "honest", "--metrics-port", "0",
          "--request-timeout", "5", "--model-dir", str(run_dir), name="honest")
    expected = _send_poison(sock, group_size)
    counted = scrape(cfg.metrics.port).by_label("reason")
    for key, count in expected.items():
        assert counted.get(key) == count, f"{key}: counted {counted.get(key)}, refused {count}"
    learner.wait(timeout=300)
    assert learner.returncode == 0, learner.log_path.read_text()[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "training went on to its target"
    for record in records:
        assert all(math.isfinite(record[key]) for key in ("loss", "grad_norm", "kl", "reward_mean")), record
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert {entry["actor_id"] for entry in ledger} == {"honest"}, "nothing from the poisoner was accepted"
    _assert_finite_checkpoint(run_dir)
