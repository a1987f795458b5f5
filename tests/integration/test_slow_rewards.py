"""A slow reward must not stall the learner's door: rollouts are verified off the request loop."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import zmq

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode

SLOW_REWARD = '''
import time

def slow(completion, prompt, **columns):
    time.sleep(0.5)  # a sympy check, a sandboxed test run, a judge
    return 0.0
'''


def _ask(sock: zmq.Socket, msg: object, timeout_ms: int = 30_000) -> object:
    sock.send(encode(msg))
    assert sock.poll(timeout_ms), f"no answer to {type(msg).__name__}"
    return decode(sock.recv())


def _hello(sock: zmq.Socket, learner, name: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-2000:]
        sock.send(encode(m.Hello(actor_id=name, host="h", backend="cpu", versions={})))
        if sock.poll(1000):
            assert isinstance(decode(sock.recv()), m.Welcome)
            while sock.poll(1000):  # Hellos queued before the learner bound are answered too
                sock.recv()
            return
    raise AssertionError("learner never answered")


def _rollouts(lease: m.Lease) -> m.Rollouts:
    """Every completion one token, rewarded 0.0: what the slow reward gives, so the check passes (cut off at
    generation.max_tokens = 1, as its finish_reason says)."""
    def completion() -> m.Completion:
        return m.Completion(tokens=m.Tensor.from_numpy(np.asarray([5], np.int32)),
                            logprobs=m.Tensor.from_numpy(np.asarray([-1.0], np.float32)), reward=0.0,
                            finish_reason="length")
    groups = [m.GroupResult(group_id=p.group_id, completions=[completion() for _ in range(4)]) for p in lease.prompts]
    return m.Rollouts(lease_id=lease.lease_id, policy_version=lease.policy_version, groups=groups)


def test_requests_are_answered_while_a_submission_is_verified(tmp_path: Path, run_config, spawn, peer_socket):
    rewards = tmp_path / "slow_rewards.py"
    rewards.write_text(SLOW_REWARD)
    config, cfg = run_config(task={"reward_module": str(rewards), "rewards": ["slow"], "reward_timeout_seconds": 10},
                             security={"verify_rewards": True, "verify_logprobs": False}, train={"steps": 1000},
                             generation={"max_tokens": 1})
    learner = spawn("learner", "--config", str(config), name="learner")
    submitter, other = peer_socket(cfg.server.bind, b"submitter"), peer_socket(cfg.server.bind, b"other")
    _hello(submitter, learner, "submitter")
    _hello(other, learner, "other")
    lease = _ask(submitter, m.LeaseRequest(max_groups=2))
    assert isinstance(lease, m.Lease) and lease.prompts
    submitter.send(encode(_rollouts(lease)))  # 2 groups x 4 completions x 0.5 s to re-score
    time.sleep(0.5)  # the learner is scoring it now
    assert isinstance(_ask(other, m.Heartbeat(actor_id="other")), m.Heartbeat)
    assert not submitter.poll(0), "the other actor was answered only after the slow submission: the door stalled"
    assert submitter.poll(30_000), "the submission is answered once its verdict is in"
    ack = decode(submitter.recv())
    assert isinstance(ack, m.Ack) and ack.status == "accepted", ack
    assert learner.poll() is None
