"""The corrupted actor of the integration tests (tests/liars/corrupt_actor.py) tells the lie it is named for."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_fleet.actor.link import LearnerLink
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
    """A LyingActor that has heard of version 7, whose link keeps what it sends (no socket is opened)."""
    made: list[LyingActor] = []

    def make(kind: str) -> LyingActor:
        monkeypatch.setattr(LearnerLink, "send", lambda self, msg: SENT.append(msg))
        actor = LyingActor(ActorConfig(connect="tcp://127.0.0.1:1"), kind)
        actor.weights.follow(7)
        made.append(actor)
        return actor

    yield make
    for actor in made:
        actor.link.shut()


SENT: list[object] = []


def sent(actor: LyingActor) -> m.Rollouts:
    """What goes out when the actor submits HONEST, from whichever path made it (the rolling batch or a lease
    run alone: both send through the link)."""
    SENT.clear()
    actor.link.send(HONEST)
    (msg,) = SENT
    assert isinstance(msg, m.Rollouts)
    return msg


def submitted(actor: LyingActor) -> m.Completion:
    return sent(actor).groups[0].completions[0]


def test_each_liar_tells_its_own_lie(liar) -> None:
    assert submitted(liar("rewards")).reward == pytest.approx(0.75)
    assert submitted(liar("logprobs")).logprobs.to_numpy().tolist() == [-0.5, -1.0]
    version_liar = liar("version")
    assert sent(version_liar).policy_version == 7
    version_liar._sync_weights()  # never loads a snapshot: it has no policy and no link, and does not fail
    assert version_liar.weights.loaded == 7  # says it holds the newest, sampling from the base model from disk
    assert submitted(liar("weights")) == HONEST.groups[0].completions[0]  # its lie is in the weights it samples from


def test_other_messages_go_out_as_they_are(liar) -> None:
    actor = liar("rewards")
    SENT.clear()
    request = m.LeaseRequest(max_groups=2)
    actor.link.send(request)
    assert SENT == [request]


def test_an_unknown_lie_is_refused() -> None:
    with pytest.raises(ValueError, match="one of rewards"):
        LyingActor(ActorConfig(connect="tcp://127.0.0.1:1"), "bogus")
