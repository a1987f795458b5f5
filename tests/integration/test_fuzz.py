"""10,000 malformed or mutated messages against a live learner process.

The learner must stay up, keep its state (step, version, ledger), and answer each
message with a reply whose error is counted in a metric.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode

FUZZ_EXAMPLES = 10_000


def _tensor(values, dtype) -> m.Tensor:
    return m.Tensor.from_numpy(np.asarray(values, dtype=dtype))


def _valid_corpus() -> list[bytes]:
    completion = m.Completion(tokens=_tensor([3, 4, 5], np.int32), logprobs=_tensor([-1.0, -2.0, -0.5], np.float32),
                              reward=0.5, finish_reason="stop")
    rollouts = m.Rollouts(lease_id="x" * 32, policy_version=0,
                          groups=[m.GroupResult(group_id="g00000001", completions=[completion] * 4)])
    return [encode(msg) for msg in (
        m.Hello(actor_id="fuzzer", host="h", backend="cpu", versions={"mlx": "0"}),
        m.LeaseRequest(max_groups=1),
        m.GetWeights(version=0),
        m.Heartbeat(actor_id="fuzzer"),
        rollouts,
    )]


CORPUS = _valid_corpus()
json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw) -> list[bytes]:
    """Frames for one hostile message: random, mutated, re-typed, or wrongly framed."""
    kind = draw(st.sampled_from(["random", "flip", "truncate", "splice", "envelope", "frames", "semantic"]))
    base = bytearray(draw(st.sampled_from(CORPUS)))
    if kind == "random":
        return [draw(st.binary(max_size=600))]
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            base[draw(st.integers(0, len(base) - 1))] = draw(st.integers(0, 255))
        return [bytes(base)]
    if kind == "truncate":
        return [bytes(base[: draw(st.integers(0, len(base) - 1))])]
    if kind == "splice":
        return [bytes(base) + draw(st.binary(min_size=1, max_size=64))]
    if kind == "envelope":
        body = draw(json_like)
        version = draw(st.sampled_from([m.PROTOCOL_VERSION, 0, 2, "1", None]))
        name = draw(st.sampled_from([*m.MESSAGE_TYPES, "Pickle", "", "__class__"]))
        return [msgpack.packb({"v": version, "type": name, "body": body}, use_bin_type=True)]
    if kind == "frames":
        return [bytes(base)] * draw(st.integers(2, 4))
    return [_semantic_violation(draw)]


def _semantic_violation(draw) -> bytes:
    """A well-formed Rollouts whose contents disagree with the run or the lease."""
    token = draw(st.sampled_from([-1, 10**6, 5]))
    logprob = draw(st.sampled_from([0.5, float("nan"), float("inf"), -1.0]))
    size = draw(st.sampled_from([1, 3, 4, 9]))
    length = draw(st.integers(1, 40))
    completion = m.Completion.model_construct(
        tokens=_tensor([token] * length, np.int32), logprobs=_tensor([logprob] * length, np.float32),
        reward=0.0, finish_reason="length",
    )
    group = m.GroupResult.model_construct(group_id=draw(st.text(min_size=1, max_size=12)), completions=[completion] * size)
    msg = m.Rollouts.model_construct(lease_id=draw(st.text(max_size=12)), policy_version=draw(st.integers(0, 5)), groups=[group])
    return encode(msg)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


@pytest.mark.slow
def test_learner_survives_ten_thousand_hostile_messages(run_config, free_port, spawn):
    config, cfg = run_config(
        task={"num_train": 50},
        # The learner's own default, not run_config's 2: this test has always run with it.
        grpo={"groups_per_step": 8},
        # Every hostile message is a violation; the fuzzer must never be shut out.
        server={"max_violations": 1000000},
        metrics={"port": free_port()},
    )
    run_dir, metrics_port = Path(cfg.run_dir), cfg.metrics.port
    learner = spawn("learner", "--config", str(config), name="learner")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"fuzzer")
    sock.connect(cfg.server.bind)
    replies: dict[str, int] = {}
    try:
        _wait_until_serving(sock, learner)
        before = _scrape(metrics_port)

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(frames=mutated())
        def send_one(frames: list[bytes]) -> None:
            sock.send_multipart(frames)
            assert sock.poll(10_000), f"no answer to {frames[0][:40]!r}"
            # Read the whole reply: a WeightsChunk carries its blob in a second frame, which
            # must not be mistaken for the answer to the next message.
            reply = decode(sock.recv_multipart()[0])
            kind = type(reply).__name__ + (f":{reply.status}" if isinstance(reply, m.Ack) else "")
            replies[kind] = replies.get(kind, 0) + 1
            if isinstance(reply, m.Ack) and reply.status != "invalid":
                # stale or duplicate groups are rejections too, counted one per group
                refused = sum(status != "accepted" for status in reply.groups.values())
                replies["refused_groups"] = replies.get("refused_groups", 0) + refused

        send_one()
        after = _scrape(metrics_port)
    finally:
        sock.close()
        ctx.term()
    assert learner.poll() is None, "the learner died"
    sent = sum(count for kind, count in replies.items() if kind != "refused_groups")
    assert sent >= FUZZ_EXAMPLES
    errors = replies.get("ErrorReply", 0)
    invalid = replies.get("Ack:invalid", 0)
    counted_errors = after["grpo_fleet_learner_protocol_errors_total"] - before.get("grpo_fleet_learner_protocol_errors_total", 0)
    counted_rejections = after["grpo_fleet_learner_rejections_total"] - before.get("grpo_fleet_learner_rejections_total", 0)
    assert counted_errors == errors, replies
    assert counted_rejections == invalid + replies.get("refused_groups", 0), replies
    assert errors + invalid > 0.9 * sent, replies
    assert after["grpo_fleet_learner_steps_total"] == 0
    assert after["grpo_fleet_learner_policy_version"] == 0
    assert after.get("grpo_fleet_learner_groups_accepted_total", 0) == 0
    assert (run_dir / "ledger.jsonl").read_text() == ""


def _wait_until_serving(sock: zmq.Socket, learner, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-2000:]
        sock.send(encode(m.Heartbeat()))
        if sock.poll(500):
            # Earlier probes may still be answered: drain them so replies line up.
            while sock.poll(1000):
                sock.recv()
            return
    raise AssertionError("learner never answered")
