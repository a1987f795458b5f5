"""The corrupted actor of the integration tests (tests/liars/corrupt_actor.py) tells the lie it is named for."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_fleet.actor.worker import ActorWorker
from grpo_fleet.config import ActorConfig
from grpo_fleet.protocol import messages as m
from liars.corrupt_actor import LyingActor

HONEST = m.Rollouts(lease_id="l1", policy_version=3, incarnation="", groups=[m.GroupResult(group_id="g1", completions=[
    m.Completion(tokens=m.Tensor.from_numpy(np.array([5, 6], dtype=np.int32)),
                 logprobs=m.Tensor.from_numpy(np.array([-1.0, -2.0], dtype=np.float32)), reward=0.5,
                 finish_reason="length"),
])])


@pytest.fixture
def liar(monkeypatch: pytest.MonkeyPatch):
    """A LyingActor whose honest self would submit HONEST and has heard of version 7 (no socket is opened)."""
    made: list[LyingActor] = []

    def make(kind: str) -> LyingActor:
        monkeypatch.setattr(ActorWorker, "_rollout", lambda self, lease: HONEST)
        actor = LyingActor(ActorConfig(connect="tcp://127.0.0.1:1"), kind)
        actor.weights.follow(7)
        made.append(actor)
        return actor

    yield make
    for actor in made:
        actor.link.shut()


LEASE = m.Lease(lease_id="l1", policy_version=3, prompts=[], deadline_seconds=60.0)


def submitted(actor: LyingActor) -> m.Completion:
    return actor._rollout(LEASE).groups[0].completions[0]


def test_each_liar_tells_its_own_lie(liar) -> None:
    assert submitted(liar("rewards")).reward == pytest.approx(0.75)
    assert submitted(liar("logprobs")).logprobs.to_numpy().tolist() == [-0.5, -1.0]
    version_liar = liar("version")
    assert version_liar._rollout(LEASE).policy_version == 7
    version_liar._sync_weights()  # never loads a snapshot: it has no policy and no link, and does not fail
    assert version_liar.weights.loaded == 0  # the base model from disk, which its honest self would submit as v0
    assert submitted(liar("weights")) == HONEST.groups[0].completions[0]  # its lie is in the weights it samples from


def test_an_unknown_lie_is_refused() -> None:
    with pytest.raises(ValueError, match="one of rewards"):
        LyingActor(ActorConfig(connect="tcp://127.0.0.1:1"), "bogus")
