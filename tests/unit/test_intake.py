"""learner/door/intake.py: accepting, refusing and replaying Rollouts, and finding groups that poisoned a step."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.leasing import NEW_ACTOR_LEASES, Leasing
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.door.intake import Intake
from grpo_fleet.learner.door.intake_rules import IntakeRules, suspect_groups, unusable_version
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import RunLog
from grpo_fleet.learner.records.state import AckCache, BatchHandOff, LearnerState
from grpo_fleet.observe.metrics import LearnerMetrics, learner_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Example


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
        "huge_reward": RejectReason.BAD_REWARD, "past_bound": RejectReason.BAD_REWARD,
        "nan_reward": RejectReason.BAD_REWARD,
        "tiny_logprob": RejectReason.BAD_LOGPROB, "nan_logprob": RejectReason.BAD_LOGPROB,
    }


# ---------------------------------------------------------------- the intake room, without a model

GROUP_SIZE, VOCAB, MAX_TOKENS = 2, 50, 4
KEY = "actor-key"


@dataclass
class Rooms:
    state: LearnerState
    registry: Registry
    intake: Intake
    handoff: BatchHandOff
    metrics: LearnerMetrics
    run_dir: Path

    def ledger(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "ledger.jsonl").read_text().splitlines()]

    def rejections(self, reason: RejectReason) -> float:
        value = self.metrics.registry.get_sample_value("grpo_fleet_learner_rejections_total", {"reason": reason})
        return value or 0.0


@pytest.fixture
def rooms(tmp_path: Path, clock) -> Iterator[Rooms]:
    cfg = RunConfig.model_validate({"generation": {"group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS},
                                    "grpo": {"groups_per_step": 2, "max_staleness": 1}})
    metrics = learner_metrics()
    state = LearnerState(run_id="run", incarnation="a" * 12, steps_target=10,
                         scheduler=PromptScheduler(8, seed=0, lease_seconds=60.0, clock=clock))
    registry = Registry(cfg.server, metrics)
    prompts = [np.array([1, 2], dtype=np.int32)] * 8
    leasing = Leasing(cfg, state, metrics, prompts, [Example(prompt="p", answer="a") for _ in prompts])
    runlog = RunLog(tmp_path)
    handoff = BatchHandOff(state, runlog, threading.RLock(), groups_per_step=2)
    intake = Intake(IntakeRules.from_config(cfg, VOCAB), state, registry, leasing, runlog, metrics, prompts, handoff)
    registry.hello(b"id", KEY, m.Hello(actor_id="a", host="h", backend="cpu", versions={}), "")
    with handoff.batch_ready:  # intake runs under the run's lock, which a wake-up needs
        yield Rooms(state, registry, intake, handoff, metrics, tmp_path)
    runlog.close()


def _wire(group_id: str, rewards: list[float], token: int = 3) -> m.GroupResult:
    return m.GroupResult(group_id=group_id, completions=[
        m.Completion(tokens=m.Tensor.from_numpy(np.array([token, token], dtype=np.int32)),
                     logprobs=m.Tensor.from_numpy(np.full(2, -1.0, dtype=np.float32)), reward=r, finish_reason="stop")
        for r in rewards
    ])


def _rollouts(rooms: Rooms, rewards: tuple[float, ...] = (0.0, 1.0), *, version: int = 0, token: int = 3) -> m.Rollouts:
    lease = rooms.state.scheduler.issue(KEY, 2)
    return m.Rollouts(lease_id=lease.lease_id, policy_version=version, incarnation=rooms.state.incarnation,
                      groups=[_wire(g, list(rewards), token) for g in lease.tickets])


def _submit(rooms: Rooms, rewards: tuple[float, ...] = (0.0, 1.0), *, version: int = 0, token: int = 3) -> m.Ack:
    return rooms.intake.take(rooms.registry.actors[b"id"], _rollouts(rooms, rewards, version=version, token=token))


def test_accepted_groups_are_ledgered_buffered_and_announce_a_batch(rooms):
    ack = _submit(rooms)
    assert ack.status == "accepted" and set(ack.groups.values()) == {"accepted"}
    assert [g.group_id for g in rooms.state.buffer] == [e["group_id"] for e in rooms.ledger()]
    assert not any(e["zero_variance"] for e in rooms.ledger())
    assert rooms.state.buffer[0].completions[0].tokens.dtype == np.int32
    assert rooms.handoff.wakeups == 1 and len(rooms.state.buffer) == 2, "a full batch wakes the training thread"
    assert rooms.registry.groups_accepted == 2


def test_a_replay_gets_the_stored_answer_and_changes_nothing(rooms):
    msg, actor = _rollouts(rooms), rooms.registry.actors[b"id"]
    first = rooms.intake.take(actor, msg)
    again = rooms.intake.take(actor, msg)
    assert again == first and len(rooms.ledger()) == 2 and len(rooms.state.buffer) == 2


def test_invalid_rollouts_change_no_state_and_count_toward_a_ban(rooms):
    ack = _submit(rooms, token=VOCAB)
    assert (ack.status, ack.reason) == ("invalid", RejectReason.TOKEN_OUT_OF_RANGE)
    assert rooms.rejections(RejectReason.TOKEN_OUT_OF_RANGE) == 1
    assert rooms.registry.bans.violations(KEY) == 1
    assert rooms.state.buffer == [] and rooms.state.scheduler.outstanding_groups == 2


def test_work_from_a_version_too_old_is_stale_and_requeued_never_a_violation(rooms):
    rooms.state.version = 2
    ack = _submit(rooms, version=0)
    assert (ack.status, ack.reason) == ("stale", RejectReason.STALE_VERSION)
    assert rooms.rejections(RejectReason.STALE_VERSION) == 2
    assert len(rooms.state.scheduler.queue.tickets) == 2 and rooms.registry.bans.violations(KEY) == 0


def test_zero_variance_groups_are_ledgered_but_not_buffered(rooms):
    assert _submit(rooms, (0.5, 0.5)).status == "accepted"
    # Their lines say they will never train, so the ledger still accounts for every accepted group.
    assert [e["zero_variance"] for e in rooms.ledger()] == [True, True] and rooms.state.buffer == []
    assert rooms.state.zero_variance_since_step == 2 and rooms.handoff.wakeups == 0


def test_nothing_is_accepted_once_the_run_is_done(rooms):
    rooms.state.step = rooms.state.steps_target
    ack = _submit(rooms)
    assert (ack.status, ack.reason) == ("stale", RejectReason.RUN_DONE) and rooms.ledger() == []


def test_unusable_version_judges_by_incarnation_and_shared_history(rooms):
    state = rooms.state
    state.version, state.history_version = 3, 2

    def judged(version: int, incarnation: str) -> object:
        msg = m.Rollouts(lease_id="x", policy_version=version, incarnation=incarnation, groups=[_wire("g", [0.0, 1.0])])
        return unusable_version(msg, state, max_staleness=1)

    assert judged(4, state.incarnation) is RejectReason.UNPUBLISHED_VERSION
    assert judged(3, "b" * 12) is RejectReason.PREVIOUS_INCARNATION
    assert judged(2, "b" * 12) is None, "shared history is good in any life"
    assert judged(1, state.incarnation) is RejectReason.STALE_VERSION


def test_the_ack_cache_is_bounded_oldest_out():
    cache = AckCache(size=2)
    for lease_id in ("a", "b", "c"):
        cache.put(lease_id, m.Ack(lease_id=lease_id, status="accepted"))
    assert cache.get("a") is None and list(cache.answers()) == ["b", "c"]


def test_reasons_keep_their_wire_values_and_say_whose_fault_they_are():
    assert str(RejectReason.BAD_LOGPROB) == f"{RejectReason.BAD_LOGPROB}" == "bad_logprob"
    assert m.Ack(lease_id="L1", status="invalid", reason=RejectReason.BAD_REWARD).model_dump()["reason"] == "bad_reward"
    assert RejectReason.NOT_YOUR_LEASE.is_violation and not RejectReason.STALE_VERSION.is_violation
    assert RejectReason.DUPLICATE.group_status == "duplicate"
    assert RejectReason.STALE_LEASE.group_status == "stale"
    assert RejectReason.TOO_LONG.group_status == "invalid"


# ---------------------------------------------------------------- groups a reward failed on


def _unscored_rollouts(rooms: Rooms, scored: int = 0) -> m.Rollouts:
    lease = rooms.state.scheduler.issue(KEY, 2)
    ids = list(lease.tickets)
    return m.Rollouts(
        lease_id=lease.lease_id, policy_version=0, incarnation=rooms.state.incarnation,
        groups=[_wire(g, [0.0, 1.0]) for g in ids[:scored]],
        unscored=[m.UnscoredGroup(group_id=g, reward="reverse_positions", error="exception", detail="ZeroDivisionError")
                  for g in ids[scored:]],
    )


def unscored_count(rooms: Rooms, reward: str, error: str) -> float:
    value = rooms.metrics.registry.get_sample_value("grpo_fleet_learner_groups_unscored_total",
                                                    {"reward": reward, "error": error})
    return value or 0.0


def test_unscored_groups_are_requeued_counted_and_never_ledgered(rooms):
    msg = _unscored_rollouts(rooms, scored=1)
    ack = rooms.intake.take(rooms.registry.actors[b"id"], msg)
    (scored,), (unscored,) = msg.groups, msg.unscored
    assert ack.status == "accepted" and ack.groups == {scored.group_id: "accepted", unscored.group_id: "requeued"}
    assert [e["group_id"] for e in rooms.ledger()] == [scored.group_id]
    assert [t.group_id for t in rooms.state.scheduler.queue.tickets] == [unscored.group_id]
    assert unscored_count(rooms, "reverse_positions", "exception") == 1
    assert rooms.registry.bans.violations(KEY) == 0, "a failing reward is not the actor's fault"


def test_a_submission_of_only_unscored_groups_is_answered_requeued(rooms):
    ack = rooms.intake.take(rooms.registry.actors[b"id"], _unscored_rollouts(rooms))
    assert ack.status == "requeued" and set(ack.groups.values()) == {"requeued"}
    assert rooms.state.buffer == [] and len(rooms.state.scheduler.queue.tickets) == 2


def test_labels_of_unscored_groups_stay_a_bounded_set(rooms):
    lease = rooms.state.scheduler.issue(KEY, 1)
    (group_id,) = lease.tickets
    msg = m.Rollouts(lease_id=lease.lease_id, policy_version=0, incarnation=rooms.state.incarnation, groups=[],
                     unscored=[m.UnscoredGroup(group_id=group_id, reward="made-up-name", error="whatever")])
    rooms.intake.take(rooms.registry.actors[b"id"], msg)
    assert unscored_count(rooms, "*", "other") == 1


def test_a_prompt_unscored_three_times_in_a_row_is_skipped_for_the_pass(rooms):
    actor = rooms.registry.actors[b"id"]
    scheduler = rooms.state.scheduler
    answers = []
    for _ in range(3):
        lease = scheduler.issue(KEY, 1)
        (group_id,) = lease.tickets
        msg = m.Rollouts(lease_id=lease.lease_id, policy_version=0, incarnation=rooms.state.incarnation, groups=[],
                         unscored=[m.UnscoredGroup(group_id=group_id, reward="reverse_positions", error="timeout")])
        answers.append(rooms.intake.take(actor, msg).groups[group_id])
    assert answers == ["requeued", "requeued", "unscorable"]
    assert scheduler.queue.tickets == [] and group_id in scheduler.finished
    assert rooms.metrics.registry.get_sample_value("grpo_fleet_learner_groups_unscorable_total") == 1
    assert rooms.ledger() == [], "a skipped prompt never counts as an accepted group"


def test_instant_unscored_returns_measure_no_speed(rooms, clock):
    """Issue 39 item 2: speed was measured from every returned group, unscored ones included, over at least 1 ms:
    two instant unscored returns read as 4,000 groups/s, and the key's cap is speed x lease_seconds."""
    actor = rooms.registry.actors[b"id"]
    for _ in range(2):
        msg = _unscored_rollouts(rooms)
        clock.advance(0.0005)
        assert rooms.intake.take(actor, msg).status == "requeued"
    unmeasured = rooms.intake.leasing.server.max_groups_per_lease * NEW_ACTOR_LEASES / 60.0
    assert actor.groups_per_second.value == pytest.approx(unmeasured), "no faster than an actor not measured"
    scored = _rollouts(rooms)
    clock.advance(1.0)
    assert rooms.intake.take(actor, scored).status == "accepted"
    assert actor.groups_per_second.value > unmeasured, "accepted groups do count"


def test_a_group_returned_unscored_goes_to_another_key_and_is_counted(rooms):
    rooms.registry.hello(b"honest", "honest-key", m.Hello(actor_id="h", host="h", backend="cpu", versions={}), "")
    msg = _unscored_rollouts(rooms)
    rooms.intake.take(rooms.registry.actors[b"id"], msg)
    returned = {u.group_id for u in msg.unscored}
    assert not returned & set(rooms.state.scheduler.issue(KEY, 2).tickets), "not back to the key that returned them"
    assert set(rooms.state.scheduler.issue("honest-key", 2).tickets) == returned
    assert rooms.metrics.registry.get_sample_value("grpo_fleet_learner_unscored_requeues_total",
                                                   {"to": "another_key"}) == 2


def test_an_unscored_group_that_was_never_leased_is_a_violation(rooms):
    lease = rooms.state.scheduler.issue(KEY, 1)
    msg = m.Rollouts(lease_id=lease.lease_id, policy_version=0, incarnation=rooms.state.incarnation, groups=[],
                     unscored=[m.UnscoredGroup(group_id="g99999999", reward="*", error="crashed")])
    ack = rooms.intake.take(rooms.registry.actors[b"id"], msg)
    assert (ack.status, ack.reason) == ("invalid", RejectReason.NOT_LEASED)
    assert rooms.state.scheduler.outstanding_groups == 1, "nothing changed"


class AgreeingRewardCheck:
    """Stands in for verification.RewardCheck: agrees with every group, and remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def verdicts(self, groups: list[tuple[m.GroupResult, int]]) -> dict[str, RejectReason | None]:
        self.asked += [(group.group_id, index) for group, index in groups]
        return {group.group_id: None for group, _ in groups}


def late_count(rooms: Rooms) -> float:
    return rooms.metrics.registry.get_sample_value("grpo_fleet_learner_late_groups_total", {"kind": "train"}) or 0.0


def test_a_late_submission_is_verified_and_accepted_once(rooms, clock):
    """Issue 38: whole leases of long answers outlived their deadline and were refused as stale_lease."""
    check = rooms.intake.verification.reward_check = AgreeingRewardCheck()
    late = _rollouts(rooms)
    clock.advance(61.0)  # past the lease's 60 s: the learner re-queues its groups
    assert rooms.state.scheduler.expire()
    ack = rooms.intake.take(rooms.registry.actors[b"id"], late)
    assert ack.status == "accepted" and set(ack.groups.values()) == {"accepted"}
    assert sorted(e["group_id"] for e in rooms.ledger()) == sorted(g.group_id for g in late.groups)
    assert sorted(gid for gid, _ in check.asked) == sorted(ack.groups), "verified like any other result"
    assert late_count(rooms) == 2 and rooms.rejections(RejectReason.STALE_LEASE) == 0
    assert rooms.state.scheduler.queue.tickets == [], "taken out of the queue: nobody does them again"
    assert rooms.intake.take(rooms.registry.actors[b"id"], late) == ack and len(rooms.ledger()) == 2


def test_a_re_leased_group_counts_for_whoever_returns_it_first(rooms, clock):
    late = _rollouts(rooms)
    clock.advance(61.0)
    rooms.state.scheduler.expire()
    rooms.registry.hello(b"id2", "other-key", m.Hello(actor_id="b", host="h", backend="cpu", versions={}), "")
    again = rooms.state.scheduler.issue("other-key", 2)
    assert set(again.tickets) == {g.group_id for g in late.groups}
    assert rooms.intake.take(rooms.registry.actors[b"id"], late).status == "accepted"
    second = m.Rollouts(lease_id=again.lease_id, policy_version=0, incarnation=rooms.state.incarnation,
                        groups=[_wire(g.group_id, [0.0, 1.0]) for g in late.groups])
    ack = rooms.intake.take(rooms.registry.actors[b"id2"], second)
    assert ack.status == "duplicate" and set(ack.groups.values()) == {"duplicate"}
    assert rooms.registry.bans.violations("other-key") == 0, "an honest actor that lost the race did nothing wrong"
    assert len(rooms.ledger()) == 2 and rooms.state.scheduler.outstanding_groups == 0


def test_a_late_submission_too_stale_to_train_leaves_its_groups_queued_once(rooms, clock):
    late = _rollouts(rooms)
    clock.advance(61.0)
    rooms.state.scheduler.expire()
    rooms.state.version = 5  # the policy moved on past max_staleness
    ack = rooms.intake.take(rooms.registry.actors[b"id"], late)
    assert (ack.status, ack.reason) == ("stale", RejectReason.STALE_VERSION)
    assert sorted(t.group_id for t in rooms.state.scheduler.queue.tickets) == sorted(ack.groups)
    assert rooms.ledger() == [] and late_count(rooms) == 0


def test_a_late_lease_lets_no_one_submit_what_it_never_held(rooms, clock):
    late = _rollouts(rooms)
    clock.advance(61.0)
    rooms.state.scheduler.expire()
    rooms.registry.hello(b"id2", "other-key", m.Hello(actor_id="b", host="h", backend="cpu", versions={}), "")
    stolen = rooms.intake.take(rooms.registry.actors[b"id2"], late)
    assert (stolen.status, stolen.reason) == ("invalid", RejectReason.NOT_YOUR_LEASE)
    fresh = rooms.state.scheduler.issue("other-key", 3)  # the two re-queued groups and a fresh one
    padded = late.model_copy(update={"groups": [*late.groups, _wire(list(fresh.tickets)[-1], [0.0, 1.0])]})
    ack = rooms.intake.take(rooms.registry.actors[b"id"], padded)
    assert (ack.status, ack.reason) == ("invalid", RejectReason.NOT_LEASED) and rooms.ledger() == []
    forgotten = late.model_copy(update={"lease_id": "f" * 32})
    ack = rooms.intake.take(rooms.registry.actors[b"id"], forgotten)
    assert ack.status == "stale" and rooms.rejections(RejectReason.STALE_LEASE) == 2


def test_rewards_are_verified_for_the_groups_of_an_open_lease(rooms):
    check = rooms.intake.verification.reward_check = AgreeingRewardCheck()
    msg = _rollouts(rooms)
    indices = {t.group_id: t.prompt_index for t in rooms.state.scheduler.ledger.leases[msg.lease_id].tickets.values()}
    assert rooms.intake.take(rooms.registry.actors[b"id"], msg).status == "accepted"
    assert sorted(check.asked) == sorted(indices.items())


def test_verify_judges_a_submission_in_one_answer_flagging_all_on_probation_and_a_share_after():
    """Verification.judge: what intake asks verify/ once per Rollouts (the bound, the flags, the reward verdicts)."""
    import random

    from grpo_fleet.learner.step.gap_bounds import default_bound
    from grpo_fleet.learner.verify.gap_calibration import HonestBounds
    from grpo_fleet.learner.verify.trust import Trust
    from grpo_fleet.learner.verify.verification import Verification

    trust = Trust(probation_groups=2, share=0.5, draw=random.Random(5))
    verification = Verification(trust=trust, bounds=HonestBounds(requested_dtype="bfloat16"))
    groups = [(_wire(f"g{i}", [0.0, 1.0]), i) for i in range(40)]
    judged = verification.judge(KEY, "cpu", groups)
    assert judged.verdicts == {} and judged.refusals() == {}, "no reward check: nothing re-scored, nothing refused"
    assert judged.flagged == {f"g{i}" for i in range(40)}, "on probation: every group"
    assert judged.bound == default_bound("bfloat16", "float32"), "the dtype the actor is told to sample in"
    trust.record_pass(KEY, 2)
    after = verification.judge(KEY, "cpu", groups).flagged
    assert 5 < len(after) < 35 and after < judged.flagged, "after probation: a share, drawn"
