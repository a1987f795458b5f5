"""The actor's rolling lease stream: leases in and Rollouts out on the link's protocol, versions exact. No sockets."""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.actor.pipeline import InFlight
from grpo_fleet.actor.rewarding import score_lease
from grpo_fleet.actor.streaming import LeaseStream, Turn
from grpo_fleet.config import TaskConfig
from grpo_fleet.models.loading import load_policy
from grpo_fleet.observe.metrics import actor_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import build_task
from grpo_fleet.tasks.reward_runner import InlineScorer

G = 4


class InOrderLearner:
    """Answers in order, as the learner does on one connection: a LeaseRequest with the next lease (an empty one
    when none is left), a Rollouts with its Ack. It refuses a second unanswered request of either kind."""

    def __init__(self, inflight: InFlight, leases: list[m.Lease]) -> None:
        self.inflight, self.leases = inflight, deque(leases)
        self.log: list[str] = []  # "L" per lease request, the lease id per submission
        self.submitted: list[m.Rollouts] = []
        self._answers: deque[object] = deque()

    def send(self, msg: object) -> None:
        if isinstance(msg, m.LeaseRequest):
            assert not any(isinstance(a, m.Lease) for a in self._answers), "a second unanswered lease request"
            self.log.append("L")
            self._answers.append(self.leases.popleft() if self.leases else
                                 m.Lease(lease_id="", deadline_seconds=1.0, policy_version=0, prompts=[], retry_after=0.0))
        elif isinstance(msg, m.Rollouts):
            assert not any(isinstance(a, m.Ack) for a in self._answers), "a second unanswered submission"
            self.log.append(msg.lease_id)
            self.submitted.append(msg)
            self._answers.append(m.Ack(lease_id=msg.lease_id, status="accepted"))

    def take_answers(self) -> None:
        while self._answers:
            answer = self._answers.popleft()
            if isinstance(answer, m.Lease):
                self.inflight.book_lease(answer)
            else:
                assert isinstance(answer, m.Ack)
                self.inflight.pair_ack(answer)

    def await_answers(self, settled: Callable[[], bool]) -> None:
        self.take_answers()
        assert settled(), "waited for an answer that will never come"

    def heartbeat(self, policy_version: int, every_seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir))


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(name="reverse", digits=3, num_train=200, num_eval=32))


def _lease(policy, task, number: int, prompts: int = 2, eval: Optional[m.EvalSampling] = None) -> m.Lease:
    items = []
    for i in range(prompts):
        example = task.train[number * prompts + i]
        tokens = policy.tokenizer.encode(example.prompt, add_special_tokens=False)
        items.append(m.PromptItem(group_id=f"g{number}-{i}", prompt_index=i, fields={"answer": example.answer},
                                  prompt_tokens=m.Tensor.from_numpy(np.asarray(tokens, np.int32)),
                                  prompt_text=example.prompt))
    return m.Lease(lease_id=f"lease{number}", deadline_seconds=60.0, policy_version=0, prompts=items, eval=eval)


def _welcome(max_staleness: Optional[int] = 2) -> m.Welcome:
    return m.Welcome(run_id="r", actor_id="a", model=m.ModelRef(path="p", digest="0" * 64),
                     generation=m.GenerationParams(group_size=G, max_tokens=8, temperature=1.0, top_p=1.0),
                     reward=m.RewardSpec(names=["reverse_positions"], weights=[1.0]), policy_version=0,
                     heartbeat_seconds=1.0, vocab_size=10, max_staleness=max_staleness)


def _stream(policy, task, leases: list[m.Lease], alone: Optional[Callable[[m.Lease], m.Rollouts]] = None):
    inflight = InFlight()
    learner = InOrderLearner(inflight, leases)
    scorer = InlineScorer(task.reward_set())

    def score(items, groups, tokenizer, metrics):
        return score_lease(items, groups, scorer, tokenizer, metrics)

    def never(lease: m.Lease) -> m.Rollouts:
        raise AssertionError("a training lease must not run alone")

    stream = LeaseStream(learner, inflight, actor_metrics(), max_groups=2, alone=alone or never, score=score)
    return stream, learner, inflight


def test_leases_decode_together_and_each_is_submitted_when_its_groups_finish(policy, task):
    mx.random.seed(0)
    leases = [_lease(policy, task, n) for n in range(4)]
    stream, learner, inflight = _stream(policy, task, leases)
    turn = Turn(_welcome(), policy, loaded=3, newest=3, stopping=False)
    for _ in range(500):
        if len(learner.submitted) == 4:
            break
        stream.turn(turn)
    assert sorted(r.lease_id for r in learner.submitted) == [f"lease{n}" for n in range(4)]
    for rollouts in learner.submitted:
        lease = leases[int(rollouts.lease_id[-1])]
        assert rollouts.policy_version == 3
        assert [g.group_id for g in rollouts.groups] == [item.group_id for item in lease.prompts]
        assert all(len(g.completions) == G for g in rollouts.groups)
    # The second lease was queued, and the third asked for, before the first was submitted: it did not wait.
    assert learner.log[:3] == ["L", "L", "L"], learner.log
    assert stream.rolling is not None and stream.rolling.usage.steps > 0


def test_a_newer_version_drains_the_batch_before_new_work(policy, task):
    mx.random.seed(1)
    stream, learner, inflight = _stream(policy, task, [_lease(policy, task, n) for n in range(3)])
    welcome = _welcome()
    for _ in range(3):  # lease0 asked for; lease0 in, lease1 asked for; lease1 queued, lease2 asked for
        stream.turn(Turn(welcome, policy, loaded=0, newest=0, stopping=False))
    assert inflight.generating == {"lease0", "lease1"} and inflight.next_lease is not None
    stale = Turn(welcome, policy, loaded=0, newest=1, stopping=False)  # the learner moved on: no refill
    while not stream.idle:
        stream.turn(stale)
        assert inflight.next_lease is not None and inflight.next_lease.lease_id == "lease2"  # held back
    assert {r.policy_version for r in learner.submitted} == {0}
    assert stream.metrics.drains.labels(reason="version")._value.get() == 1
    drain_cost = stream.metrics.drain_idle_slots._value.get()
    assert drain_cost > 0  # the tail of the drain: slots that emptied with nothing to take them
    stream.turn(stale)  # idle now: still not at v0, where the worker would sync first
    assert inflight.next_lease is not None
    synced = Turn(welcome, policy, loaded=1, newest=1, stopping=False)
    while len(learner.submitted) < 3:
        stream.turn(synced)
    assert learner.submitted[-1].lease_id == "lease2" and learner.submitted[-1].policy_version == 1
    assert stream.metrics.drain_idle_slots._value.get() == drain_cost  # no drain since: nothing more counted


def test_one_version_behind_nothing_new_starts_at_the_default_bound(policy, task):
    stream, learner, inflight = _stream(policy, task, [_lease(policy, task, 0)])
    for _ in range(2):  # lease0 asked for; then held: the worker syncs first
        stream.turn(Turn(_welcome(), policy, loaded=0, newest=1, stopping=False))
    assert not inflight.generating and inflight.next_lease is not None and stream.idle


def test_an_eval_lease_runs_alone_once_the_batch_is_empty(policy, task):
    mx.random.seed(2)
    evaluated: list[str] = []
    stream: LeaseStream

    def alone(lease: m.Lease) -> m.Rollouts:
        assert stream.idle, "the eval lease ran with training sequences still decoding"
        evaluated.append(lease.lease_id)
        unscored = [m.UnscoredGroup(group_id=item.group_id, reward="r", error="raised") for item in lease.prompts]
        return m.Rollouts(lease_id=lease.lease_id, policy_version=0, groups=[], unscored=unscored)

    leases = [_lease(policy, task, 0), _lease(policy, task, 1, eval=m.EvalSampling(samples=1, temperature=0.0)),
              _lease(policy, task, 2)]
    stream, learner, inflight = _stream(policy, task, leases, alone)
    turn = Turn(_welcome(), policy, loaded=0, newest=0, stopping=False)
    for _ in range(500):
        if len(learner.submitted) == 3:
            break
        stream.turn(turn)
    assert evaluated == ["lease1"]
    assert [r.lease_id for r in learner.submitted] == ["lease0", "lease1", "lease2"]
    assert stream.metrics.drains.labels(reason="eval")._value.get() == 1


def test_stopping_delivers_what_is_in_hand_and_asks_for_nothing_more(policy, task):
    stream, learner, inflight = _stream(policy, task, [_lease(policy, task, n) for n in range(3)])
    for _ in range(2):  # lease0 asked for; lease0 in, lease1 asked for
        stream.turn(Turn(_welcome(), policy, loaded=0, newest=0, stopping=False))
    stopping = Turn(_welcome(), policy, loaded=0, newest=0, stopping=True)
    for _ in range(200):
        if inflight.drained:
            break
        stream.turn(stopping)
    assert inflight.drained and learner.log.count("L") == 2
    assert sorted(r.lease_id for r in learner.submitted) == ["lease0", "lease1"]


def test_a_lease_names_the_learner_life_it_was_sampled_in(policy, task):
    # The learner restarted while the lease decoded: its version number is of the old life, and so is its stamp.
    stream, learner, inflight = _stream(policy, task, [_lease(policy, task, 0)])
    before = _welcome().model_copy(update={"incarnation": "a" * 12})
    for _ in range(2):  # lease0 asked for; lease0 in
        stream.turn(Turn(before, policy, loaded=5, newest=5, stopping=False))
    assert inflight.generating == {"lease0"}
    after = Turn(_welcome().model_copy(update={"incarnation": "b" * 12}), policy, loaded=-1, newest=5, stopping=False)
    while not learner.submitted:
        stream.turn(after)
    assert (learner.submitted[0].incarnation, learner.submitted[0].policy_version) == ("a" * 12, 5)


def test_a_loose_bound_keeps_refilling_a_version_behind(policy, task):
    stream, learner, inflight = _stream(policy, task, [_lease(policy, task, 0)])
    for _ in range(2):  # lease0 asked for; lease0 in at v0 while the learner is at v1
        stream.turn(Turn(_welcome(max_staleness=4), policy, loaded=0, newest=1, stopping=False))
    assert inflight.generating == {"lease0"} or learner.submitted
