"""A deterministic environment that hangs on an actor's turn text stops neither other actors' checks nor the
learner's shutdown (issue 39, item 1): the learner replays episodes in a child process it can kill.

Before, the replay ran in the learner's own process, on its one verifier thread: the first hang below left every
later submission unanswered, and a stop waited for ever.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from test_slow_rewards import _ask, _hello

from grpo_fleet.models.loading import load_policy
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode

DEMO = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"
GROUP = 8

# "sleep" hangs in Python: the per-call timer (task.env_timeout_seconds) ends it. "block" hangs with the timer's signal
# blocked, as C code can: only killing the process ends it.
HANGS_ENV = '''
import signal, time

class Hangs:
    deterministic = True

    def __init__(self, env_config, extras):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        if "sleep" in action:
            time.sleep(3600)
        if "block" in action:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return {"observations": [], "reward": 0.0, "done": True, "metadata": {}}
'''


def _episode(tokenizer: Any, text: str) -> m.Completion:
    """One turn saying `text`, ended by its stop token; the environment rewards it 0 (as reported)."""
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [min(int(t) for t in tokenizer.eos_token_ids)]
    n = len(ids)
    return m.Completion(tokens=m.Tensor.from_numpy(np.asarray(ids, np.int32)),
                        logprobs=m.Tensor.from_numpy(np.full(n, -1.0, np.float32)), reward=0.0, finish_reason="stop",
                        mask=m.Tensor.from_numpy(np.ones(n, np.uint8)), turns=[0], end="done")


def _submit(sock: zmq.Socket, tokenizer: Any, first: str) -> tuple[m.Lease, m.Rollouts]:
    """Lease one group and send it: the first episode says `first`, the others "ok"."""
    lease = _ask(sock, m.LeaseRequest(max_groups=1))
    assert isinstance(lease, m.Lease) and len(lease.prompts) == 1, lease
    completions = [_episode(tokenizer, first)] + [_episode(tokenizer, "ok") for _ in range(GROUP - 1)]
    rollouts = m.Rollouts(lease_id=lease.lease_id, policy_version=lease.policy_version,
                          groups=[m.GroupResult(group_id=lease.prompts[0].group_id, completions=completions)])
    sock.send(encode(rollouts))
    return lease, rollouts


def _ack(sock: zmq.Socket, timeout_s: float) -> m.Ack:
    assert sock.poll(int(timeout_s * 1000)), f"no Ack within {timeout_s}s"
    ack = decode(sock.recv())
    assert isinstance(ack, m.Ack), ack
    return ack


def test_a_hanging_replay_is_charged_others_are_verified_and_the_learner_stops_in_10s(
        tmp_path: Path, run_config, spawn, peer_socket, tiny_chat_model_dir):
    env_file = tmp_path / "hangs.py"
    env_file.write_text(HANGS_ENV)
    config, cfg = run_config(
        model={"path": str(tiny_chat_model_dir)},
        task={"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl"), "rewards": [], "chat_template": True,
              "env": f"{env_file}:Hangs", "max_turns": 2, "max_episode_tokens": 64, "env_timeout_seconds": 1.0},
        generation={"group_size": GROUP, "max_tokens": 8},
        train={"steps": 1000},
        # A replay's budget far past the 10 s a stop may take: the stop must end the replay, not wait it out (a
        # group's batch of calls would otherwise be waited on for 2 x 8 calls x 1 s + 2 s).
        security={"verify_rewards": True, "verify_logprobs": False, "replay_seconds": 60.0},
    )
    tokenizer = load_policy(str(tiny_chat_model_dir)).tokenizer
    for word in ("sleep", "block", "ok"):
        assert word in tokenizer.decode(tokenizer.encode(word, add_special_tokens=False))
    learner = spawn("learner", "--config", str(config), name="learner")
    hostile, honest = peer_socket(cfg.server.bind, b"hostile"), peer_socket(cfg.server.bind, b"honest")
    _hello(hostile, learner, "hostile")
    _hello(honest, learner, "honest")

    _, hung = _submit(hostile, tokenizer, "sleep")
    time.sleep(0.3)  # the learner is replaying it: its first episode's step hangs
    _, fine = _submit(honest, tokenizer, "ok")
    honest_ack = _ack(honest, 30)
    assert honest_ack.groups == {fine.groups[0].group_id: "accepted"}, honest_ack
    hostile_ack = _ack(hostile, 30)
    assert hostile_ack.groups == {hung.groups[0].group_id: "invalid"}, hostile_ack  # charged: env_replay_timeout
    assert "env_replay_timeout" in learner.log_path.read_text()

    _submit(hostile, tokenizer, "block")
    time.sleep(1.5)  # past the per-call timer: only a kill ends this one
    assert learner.poll() is None
    stopping = time.monotonic()
    learner.terminate()
    assert learner.wait(timeout=10) == 0, learner.log_path.read_text()[-3000:]
    assert time.monotonic() - stopping < 10
