"""actor/rewarding.RunRewards: the actor's rewards process, started once per set of rewards (no process here: a fake)."""

from __future__ import annotations

import pytest

from grpo_fleet.actor import rewarding
from grpo_fleet.actor.admission import ActorRefused
from grpo_fleet.actor.rewarding import RunRewards
from grpo_fleet.tasks.reward_runner import RewardSet, RewardsRefused

EXACT = RewardSet(names=("exact_match",), weights=(1.0,))
OTHER = RewardSet(names=("exact_match",), weights=(0.5,))


class FakeProcess:
    def __init__(self, rewards: RewardSet) -> None:
        if rewards.module == "broken":
            raise RewardsRefused("no module named broken")
        self.rewards, self.closed = rewards, False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def rewards(monkeypatch) -> RunRewards:
    monkeypatch.setattr(rewarding, "ScoringProcess", FakeProcess)
    return RunRewards()


def test_the_same_rewards_keep_their_process(rewards):
    rewards.start(EXACT)
    first = rewards.scorer
    rewards.start(EXACT)
    assert rewards.scorer is first and not first.closed


def test_new_rewards_close_the_old_process_and_start_one_of_their_own(rewards):
    rewards.start(EXACT)
    first = rewards.scorer
    rewards.start(OTHER)
    assert first.closed and rewards.scorer is not first and rewards.scorer.rewards == OTHER
    rewards.close()
    assert rewards.scorer.closed


def test_rewards_that_cannot_load_refuse_the_run(rewards):
    rewards.start(EXACT)
    with pytest.raises(ActorRefused, match="cannot run the learner's rewards"):
        rewards.start(RewardSet(names=("exact_match",), weights=(1.0,), module="broken"))
    assert rewards.scorer is None and rewards.rewards == EXACT
