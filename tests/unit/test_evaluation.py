"""Eval rounds as eval leases (learner/evals/evaluation.py): no sockets, no model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.registry import ActorInfo, Registry
from grpo_fleet.learner.evals.evaluation import Evaluation, eval_lease_size, eval_summary
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.observe.metrics import LearnerMetrics, learner_metrics
from grpo_fleet.observe.plotting import load_eval_records, load_step_records
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Example

VOCAB, MAX_TOKENS, PROMPTS = 50, 4, 5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Desk:
    evaluation: Evaluation
    state: LearnerState
    registry: Registry
    metrics: LearnerMetrics
    clock: Clock
    run_dir: Path

    def actor(self, key: str = "k1") -> ActorInfo:
        identity = key.encode()
        if identity not in self.registry.actors:
            self.registry.hello(identity, key, m.Hello(actor_id=f"a-{key}", host="h", backend="cpu", versions={}), "")
        return self.registry.actors[identity]

    def rows(self) -> list[dict]:
        return load_eval_records(self.run_dir / "metrics.jsonl")


def make_desk(tmp_path: Path, **train: object) -> Iterator[Desk]:
    cfg = RunConfig.model_validate({"generation": {"group_size": 2, "max_tokens": MAX_TOKENS},
                                    "train": {"eval_every": 10, **train}, "server": {"max_groups_per_lease": 2}})
    metrics, clock = learner_metrics(), Clock()
    state = LearnerState(run_id="run", incarnation="a" * 12, steps_target=30,
                         scheduler=PromptScheduler(8, seed=0, lease_seconds=60.0))
    registry = Registry(cfg.server, metrics)
    runlog = RunLog(tmp_path)
    examples = [Example(prompt=f"p{i}", answer=str(i)) for i in range(PROMPTS)]
    tokens = [np.array([1, 2 + i], dtype=np.int32) for i in range(PROMPTS)]
    evaluation = Evaluation(cfg, examples, tokens, VOCAB, state, registry, runlog, metrics, clock=clock)
    yield Desk(evaluation, state, registry, metrics, clock, tmp_path)
    runlog.close()


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    yield from make_desk(tmp_path)


def answer(lease: m.Lease, rewards: dict[int, list[float]], version: int = 0) -> m.Rollouts:
    groups = [m.GroupResult(group_id=item.group_id, completions=[
        m.Completion(tokens=m.Tensor.from_numpy(np.array([3], dtype=np.int32)),
                     logprobs=m.Tensor.from_numpy(np.array([-0.5], dtype=np.float32)), reward=r, finish_reason="stop")
        for r in rewards[item.prompt_index]]) for item in lease.prompts]
    return m.Rollouts(lease_id=lease.lease_id, policy_version=version, groups=groups)


def test_eval_summary_matches_the_formulas() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5], [0.0, 1.0, 1.0, 1.0]]
    avg, passed = eval_summary(rewards, pass_reward=1.0)
    assert avg == pytest.approx(np.mean(np.mean(np.array(rewards), axis=1)))
    assert passed == pytest.approx(2 / 3), "prompts with at least one sample reaching 1.0"
    assert eval_summary([], 1.0) == (None, None)


def test_a_round_is_leased_returned_and_written_once_complete(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    rewards = {i: [i / 4] for i in range(PROMPTS)}
    leases = []
    while (lease := desk.evaluation.grant(desk.actor(), m.LeaseRequest(max_groups=8))) is not None:
        assert lease.eval == m.EvalSampling(samples=1, temperature=0.0), "greedy by default"
        assert len(lease.prompts) <= 2, "server.max_groups_per_lease bounds eval leases too"
        assert lease.prompts[0].fields["answer"] == str(lease.prompts[0].prompt_index)
        leases.append(lease)
    assert sum(len(lease.prompts) for lease in leases) == PROMPTS
    for lease in leases[:-1]:
        assert desk.evaluation.take(desk.actor(), answer(lease, rewards)).status == "accepted"
    assert desk.rows() == [], "not written before the last prompt is back"
    desk.evaluation.take(desk.actor(), answer(leases[-1], rewards, version=1))
    (row,) = desk.rows()
    assert row["eval_reward"] == pytest.approx(np.mean([i / 4 for i in range(PROMPTS)]))
    assert (row["step"], row["scored"], row["k"], row["mode"]) == (0, PROMPTS, 1, "greedy")
    assert (row["sampled_version_min"], row["sampled_version_max"]) == (0, 1)
    assert desk.metrics.registry.get_sample_value("grpo_fleet_learner_eval_reward") == pytest.approx(row["eval_reward"])
    assert load_step_records(desk.run_dir / "metrics.jsonl") == [], "eval lines are not step lines"
    assert desk.evaluation.current is None and desk.state.buffer == [] and desk.state.scheduler.finished == set()


def test_sampled_rounds_ask_for_k_samples_and_report_pass_at_k(tmp_path: Path) -> None:
    for desk in make_desk(tmp_path, eval_mode="sampled", eval_samples=3, eval_temperature=0.7):
        desk.evaluation.start(10, 2)
        while (lease := desk.evaluation.grant(desk.actor(), m.LeaseRequest(max_groups=8))) is not None:
            assert lease.eval == m.EvalSampling(samples=3, temperature=0.7)
            desk.evaluation.take(desk.actor(), answer(lease, {i: [0.0, float(i % 2), 0.0] for i in range(PROMPTS)}))
        (row,) = desk.rows()
        assert row["eval_pass_at_k"] == pytest.approx(2 / 5) and row["k"] == 3


def test_wrong_group_size_or_someone_elses_lease_is_a_violation(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    lease = desk.evaluation.grant(desk.actor("k1"), m.LeaseRequest(max_groups=2))
    assert lease is not None
    stolen = desk.evaluation.take(desk.actor("k2"), answer(lease, {i: [1.0] for i in range(PROMPTS)}))
    assert (stolen.status, stolen.reason) == ("invalid", RejectReason.NOT_YOUR_LEASE)
    padded = desk.evaluation.take(desk.actor("k1"), answer(lease, {i: [1.0, 1.0] for i in range(PROMPTS)}))
    assert (padded.status, padded.reason) == ("invalid", RejectReason.BAD_GROUP_SIZE)
    assert desk.registry.bans.violations("k2") == 1 and desk.registry.bans.violations("k1") == 1
    assert desk.evaluation.owns(lease.lease_id), "refusals change nothing: the lease is still open"


def test_expired_and_orphaned_eval_leases_go_back_in_the_round(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    first = desk.evaluation.grant(desk.actor("k1"), m.LeaseRequest(max_groups=2))
    second = desk.evaluation.grant(desk.actor("k2"), m.LeaseRequest(max_groups=2))
    assert first is not None and second is not None
    desk.evaluation.release_actor("k2")
    desk.clock.now += 61
    desk.evaluation.expire()
    assert len(desk.evaluation.current.pending) == PROMPTS and not desk.evaluation.current.leases
    assert {first.lease_id, second.lease_id} <= set(desk.evaluation.current.late), "kept for a late result"


def test_eval_leases_are_sized_by_the_actors_speed_in_completions() -> None:
    # 0.1 training groups/s of 8 completions: 0.8 greedy prompts/s, 24 in 30 s; 3 when each is 8 samples too.
    assert eval_lease_size(64, 16, 0.1, group_size=8, samples=1, target_seconds=30.0) == 16
    assert eval_lease_size(64, 16, 0.1, group_size=8, samples=8, target_seconds=30.0) == 3
    assert eval_lease_size(64, 16, 0.001, group_size=8, samples=8, target_seconds=30.0) == 1, "at least one"
    assert eval_lease_size(4, 16, None, group_size=8, samples=1, target_seconds=30.0) == 4, "unmeasured: as asked"


def test_a_slow_actor_gets_a_small_eval_lease_and_its_return_measures_it(desk: Desk) -> None:
    """Issue 38: eval leases were sized by count, so every one of long greedy answers outlived its deadline."""
    desk.evaluation.start(0, 0)
    slow = desk.actor("k1")
    slow.groups_per_second.add(0.01)  # a group of 2 in 100 s: one greedy prompt in 50 s, none in the 30 s target
    lease = desk.evaluation.grant(slow, m.LeaseRequest(max_groups=8))
    assert lease is not None and len(lease.prompts) == 1
    desk.clock.now += 40.0
    desk.evaluation.take(slow, answer(lease, {i: [1.0] for i in range(PROMPTS)}))
    # 0.5 training groups in 40 s, averaged with the 0.01 it had.
    assert slow.groups_per_second.value > 0.01 and slow.last_return == desk.clock.now


def test_an_eval_lease_is_extended_while_its_actor_works(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    lease = desk.evaluation.grant(desk.actor("k1"), m.LeaseRequest(max_groups=2))
    assert lease is not None
    desk.clock.now += 61
    desk.evaluation.expire(lambda key: key == "k1")
    assert desk.evaluation.current.leases[lease.lease_id].deadline == pytest.approx(desk.clock.now + 59)
    desk.clock.now += 120  # past 3 x lease_seconds from its issue (server.max_lease_seconds' default)
    desk.evaluation.expire(lambda key: True)
    assert lease.lease_id in desk.evaluation.current.late and len(desk.evaluation.current.pending) == PROMPTS


def _late_counted(desk: Desk) -> float:
    return desk.metrics.registry.get_sample_value("grpo_fleet_learner_late_groups_total", {"kind": "eval"}) or 0.0


def _expired_then_re_leased(desk: Desk) -> tuple[m.Lease, list[m.Lease]]:
    """A round whose first lease (k1's) expired, then the whole round out again to k2, its prompts among them."""
    desk.evaluation.start(0, 0)
    late = desk.evaluation.grant(desk.actor("k1"), m.LeaseRequest(max_groups=2))
    assert late is not None
    desk.clock.now += 61
    desk.evaluation.expire()
    others = []
    while (lease := desk.evaluation.grant(desk.actor("k2"), m.LeaseRequest(max_groups=2))) is not None:
        others.append(lease)
    return late, others


def test_a_late_eval_result_scores_what_nobody_has_scored_yet(desk: Desk) -> None:
    late, others = _expired_then_re_leased(desk)
    rewards = {i: [1.0] for i in range(PROMPTS)}
    ack = desk.evaluation.take(desk.actor("k1"), answer(late, rewards))
    assert ack.status == "accepted" and set(ack.groups.values()) == {"eval"} and _late_counted(desk) == 2
    answers = [desk.evaluation.take(desk.actor("k2"), answer(lease, {i: [0.0] for i in range(PROMPTS)}))
               for lease in others]
    assert sum(v == "duplicate" for a in answers for v in a.groups.values()) == 2, "the first result won"
    (row,) = desk.rows()
    assert row["scored"] == PROMPTS and row["eval_reward"] == pytest.approx(2 / PROMPTS)
    assert desk.registry.bans.violations("k1") == 0 and desk.registry.bans.violations("k2") == 0


def test_a_result_no_round_waits_for_is_stale_never_judged_as_training(desk: Desk) -> None:
    late, others = _expired_then_re_leased(desk)
    for lease in others:
        desk.evaluation.take(desk.actor("k2"), answer(lease, {i: [1.0] for i in range(PROMPTS)}))
    assert desk.evaluation.current is None and len(desk.rows()) == 1, "the round finished without it"
    msg = answer(late, {i: [1.0] for i in range(PROMPTS)})
    assert desk.evaluation.claims(msg), "eval groups go to the eval room even when no round owns their lease"
    ack = desk.evaluation.take(desk.actor("k1"), msg)
    assert (ack.status, ack.reason) == ("stale", RejectReason.EVAL_ROUND_DONE) and not RejectReason.EVAL_ROUND_DONE.is_violation
    assert desk.registry.bans.violations("k1") == 0 and len(desk.rows()) == 1
    training = m.Rollouts(lease_id=late.lease_id, policy_version=0, groups=[
        g.model_copy(update={"group_id": "g00000001"}) for g in msg.groups[:1]])
    assert not desk.evaluation.claims(training)


def test_unscored_eval_prompts_are_retried_then_left_out(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    for _ in range(20):
        lease = desk.evaluation.grant(desk.actor(), m.LeaseRequest(max_groups=8))
        if lease is None:
            break
        scored = answer(lease, {i: [1.0] for i in range(PROMPTS)}).groups
        unscored = [m.UnscoredGroup(group_id=item.group_id, reward="*", error="timeout")
                    for item in lease.prompts if item.prompt_index == 0]
        msg = m.Rollouts(lease_id=lease.lease_id, policy_version=0, unscored=unscored,
                         groups=[g for g in scored if g.group_id not in {u.group_id for u in unscored}])
        desk.evaluation.take(desk.actor(), msg)
    (row,) = desk.rows()
    assert (row["scored"], row["dropped"]) == (PROMPTS - 1, 1)


def test_the_learner_takes_a_round_no_actor_took(desk: Desk) -> None:
    desk.evaluation.start(20, 4)
    assert desk.evaluation.claim_for_learner(wait_seconds=10) == [], "actors get the first chance"
    desk.clock.now += 11
    claimed = desk.evaluation.claim_for_learner(wait_seconds=10)
    assert claimed == list(range(PROMPTS)) and desk.evaluation.grant(desk.actor(), m.LeaseRequest(max_groups=2)) is None
    desk.evaluation.record_learner({i: [1.0] if i else None for i in claimed}, version=4)
    desk.evaluation.finish()
    (row,) = desk.rows()
    assert (row["on_learner"], row["dropped"], row["eval_reward"]) == (PROMPTS - 1, 1, 1.0)


def test_a_round_due_while_one_runs_starts_when_it_finishes(desk: Desk) -> None:
    desk.evaluation.start(0, 0)
    desk.evaluation.start(10, 1)
    assert desk.evaluation.current.step == 0
    desk.state.step, desk.state.version = 12, 2
    desk.clock.now += 11
    desk.evaluation.record_learner({i: [0.0] for i in desk.evaluation.claim_for_learner(10)}, version=0)
    desk.evaluation.finish()
    assert desk.evaluation.current is not None and desk.evaluation.current.step == 12
    assert [step for step, _ in desk.evaluation.finished] == [12]
    assert json.loads((desk.run_dir / "metrics.jsonl").read_text())["event"] == "eval"
    assert desk.evaluation.due(20, final=False) and desk.evaluation.due(23, final=True)
    assert not desk.evaluation.due(23, final=False)


@pytest.mark.parametrize("mode, samples, temperature", [("greedy", 1, 0.0), ("sampled", 4, 0.7)])
def test_in_process_evaluate_scores_as_the_learners_rounds_do(monkeypatch, mode, samples, temperature) -> None:
    """Baselines (bench) are scored by `evaluate`: the same mode, k and temperature as the fleet's eval rounds."""
    import grpo_fleet.models.evaluate as evaluate_module
    from grpo_fleet.tasks import build_task

    cfg = RunConfig.model_validate({"train": {"eval_mode": mode, "eval_samples": 4, "eval_temperature": 0.7},
                                    "task": {"num_train": 10, "num_eval": 3}})
    asked = {}

    def scored(model, tokenizer, task, cfg, examples, scorer, *, samples, temperature, batch_size):
        asked.update(samples=samples, temperature=temperature, examples=len(examples))
        per_prompt = {1: [[1.0], [0.0], None], 4: [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], None]}
        return per_prompt[samples]

    monkeypatch.setattr(evaluate_module, "sample_and_score", scored)
    reward = evaluate_module.evaluate(None, None, build_task(cfg.task), cfg)
    assert asked == {"samples": samples, "temperature": temperature, "examples": 3}
    # avg@k over the scorable prompts: (1/4 + 1) / 2 sampled; (1 + 0) / 2 greedy.
    assert reward == pytest.approx(0.625 if mode == "sampled" else 0.5)
