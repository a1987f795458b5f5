"""What an environment replay may cost the learner, and who pays (issue 39, item 1): the actor whose turns made
the replay run out of time or made the environment fail is charged; only env.init's failure, which sees nothing of
the actor's, is the learner's; and a prompt whose check keeps failing is skipped for the pass, not re-queued for
ever. (The replay here runs in this process; the hang that only a killed child ends: tests/integration.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from test_learner_core import ask, hello, lease, rejections, sample

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.protocol import messages as m
from in_process import build_learner

DEMO = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"
GROUP = 4
A, B, C = b"actor-a", b"actor-b", b"actor-c"

# The actor's turn text decides what the environment does: "slow" takes 1 s (past the replay_seconds of 0.5 below),
# "raise" raises; anything else ends the episode with reward 0. With env_config init_fails, env.init raises.
LAZY_ENV = '''
import time

class Lazy:
    deterministic = True

    def __init__(self, env_config, extras):
        self.init_fails = env_config.get("init_fails", False)

    def init(self, prompt):
        if self.init_fails:
            raise RuntimeError("the environment's own bug")
        return prompt, {}

    def step(self, action):
        if "slow" in action:
            time.sleep(1.0)
        if "raise" in action:
            raise ValueError("not on this action")
        return {"observations": [], "reward": 0.0, "done": True, "metadata": {}}
'''


@pytest.fixture
def make(tiny_chat_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., RunCoordinator]]:
    env_file = tmp_path / "lazy.py"
    env_file.write_text(LAZY_ENV)
    built: list[RunCoordinator] = []

    def build(init_fails: bool = False) -> RunCoordinator:
        cfg = RunConfig.model_validate({
            "run_dir": str(tmp_path / f"run{len(built)}"), "model": {"path": str(tiny_chat_model_dir)},
            "task": {"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl"), "rewards": [],
                     "chat_template": True, "env": f"{env_file}:Lazy", "env_config": {"init_fails": init_fails},
                     "max_turns": 2, "max_episode_tokens": 64},
            "generation": {"group_size": GROUP, "max_tokens": 8}, "grpo": {"groups_per_step": 2},
            "train": {"steps": 3}, "metrics": {"port": 0},
            "security": {"verify_rewards": True, "verify_logprobs": False, "replay_seconds": 0.5},
        })
        learner = build_learner(cfg)
        built.append(learner)
        return learner

    yield build
    for learner in built:
        learner.close()


def _episode(tokenizer: Any, text: str) -> m.Completion:
    """One turn saying `text`, ended by its stop token, reported at the environment's reward (0)."""
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [min(tokenizer.eos_token_ids)]
    n = len(ids)
    return m.Completion(tokens=m.Tensor.from_numpy(np.asarray(ids, np.int32)),
                        logprobs=m.Tensor.from_numpy(np.full(n, -1.0, np.float32)), reward=0.0, finish_reason="stop",
                        mask=m.Tensor.from_numpy(np.ones(n, np.uint8)), turns=[0], end="done")


def _submit(learner: RunCoordinator, identity: bytes, first: str, max_groups: int = 1) -> tuple[m.Lease, m.Ack]:
    """Lease groups and send them back: in each, the first episode says `first`, the others "ok"."""
    lease_msg = lease(learner, identity, max_groups=max_groups)
    tokenizer = learner.policy.tokenizer
    groups = [m.GroupResult(group_id=p.group_id, completions=[_episode(tokenizer, first)]
                            + [_episode(tokenizer, "ok") for _ in range(GROUP - 1)]) for p in lease_msg.prompts]
    ack = ask(learner, identity, m.Rollouts(lease_id=lease_msg.lease_id, policy_version=lease_msg.policy_version,
                                            incarnation=learner.state.incarnation, groups=groups))
    assert isinstance(ack, m.Ack)
    return lease_msg, ack


def _violations(learner: RunCoordinator, reason: str) -> float:
    return sample(learner, "grpo_fleet_learner_violations_total", {"reason": reason})


def test_a_replay_the_actors_turns_hold_past_replay_seconds_is_charged_to_it(make):
    learner = make()
    hello(learner, A)
    _, ack = _submit(learner, A, "slow", max_groups=2)
    # Both groups refused: the first ran out of time, the second is charged alike without being replayed.
    assert set(ack.groups.values()) == {"invalid"}, ack
    assert rejections(learner, "env_replay_timeout") == 2 == _violations(learner, "env_replay_timeout")
    _, honest = _submit(learner, A, "ok")
    assert set(honest.groups.values()) == {"accepted"}  # the replay goes on for the next submission


def test_an_environment_failing_on_the_actors_turn_is_its_mismatch(make):
    learner = make()
    hello(learner, A)
    _, ack = _submit(learner, A, "raise")
    assert set(ack.groups.values()) == {"invalid"}, ack
    assert rejections(learner, "env_replay_mismatch") == 1 == _violations(learner, "env_replay_mismatch")
    assert rejections(learner, "reward_unverifiable") == 0  # before: unverifiable, charged to no one


def test_env_init_failing_is_the_learners_and_the_prompt_is_skipped_after_a_few_tries(make):
    learner = make(init_fails=True)
    hello(learner, A, "actor-a")
    hello(learner, B, "actor-b")
    tried = []
    for identity in (A, B, A):  # each refusal sends the prompt to the other key first
        lease_msg, ack = _submit(learner, identity, "ok")
        tried.append(lease_msg.prompts[0].prompt_index)
        assert set(ack.groups.values()) == {"stale"}, ack  # not the actor's fault: re-queued, never a violation
    assert len(set(tried)) == 1 and rejections(learner, "reward_unverifiable") == 3
    assert sum(learner.metrics.registry.get_sample_value("grpo_fleet_learner_violations_total", {"reason": r}) or 0
               for r in ("reward_unverifiable", "env_replay_timeout", "env_replay_mismatch")) == 0
    assert sample(learner, "grpo_fleet_learner_groups_unscorable_total") == 1  # given up on for this pass
    lease_msg, _ = _submit(learner, B, "ok")
    assert lease_msg.prompts[0].prompt_index != tried[0]
