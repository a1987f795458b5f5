"""learner/intake.py: finding the accepted groups that could have poisoned a step."""

from __future__ import annotations

import numpy as np

from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.intake import suspect_groups


def _group(group_id: str, rewards: list[float], logprob: float = -1.0) -> AcceptedGroup:
    completions = [CompletionRecord(tokens=np.array([3, 4], dtype=np.int32),
                                    logprobs=np.full(2, logprob, dtype=np.float32), reward=r, finish_reason="stop")
                   for r in rewards]
    return AcceptedGroup(group_id=group_id, prompt_index=0, prompt_tokens=np.array([1], dtype=np.int32),
                         completions=completions, policy_version=0, actor_id="a", actor_key="k")


def test_only_groups_with_values_out_of_float32_bounds_are_suspects():
    groups = [
        _group("clean", [0.0, 1.0]),
        _group("huge_reward", [0.0, 1e39]),  # finite in float64, inf in float32
        _group("past_bound", [0.0, 5e4]),
        _group("nan_reward", [0.0, float("nan")]),
        _group("tiny_logprob", [0.0, 1.0], logprob=-3e38),
        _group("nan_logprob", [0.0, 1.0], logprob=float("nan")),
    ]
    assert suspect_groups(groups, reward_bound=1e4) == {
        "huge_reward": "bad_reward", "past_bound": "bad_reward", "nan_reward": "bad_reward",
        "tiny_logprob": "bad_logprob", "nan_logprob": "bad_logprob",
    }
