"""Tests for grpo_fleet.learner.actors.leasing: lease sizing from measured actor speed, in-flight capacity, retry-after."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.leasing import (
    DEADLINE_SHARE,
    MAX_RETRY_SECONDS,
    MAX_SPEEDUP,
    MIN_MEASURED_SECONDS,
    MIN_RETRY_SECONDS,
    NEW_ACTOR_LEASES,
    SPEEDUP_BASE,
    Leasing,
    actor_cap,
    key_share,
    lease_size,
    lease_target_seconds,
    retry_after,
    speed_sample,
    unmeasured_speed,
)
from grpo_fleet.learner.actors.rates import MovingAverage
from grpo_fleet.learner.actors.registry import ActorInfo
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import Example


def test_moving_average_starts_at_the_first_sample_then_follows_new_ones():
    average = MovingAverage(weight=0.5)
    assert average.value is None
    assert average.add(10.0) == 10.0
    assert average.add(20.0) == 15.0
    for _ in range(30):
        average.add(2.0)
    assert average.value == pytest.approx(2.0, abs=1e-6)


def test_an_unmeasured_actor_gets_what_it_asked_for_within_the_limit():
    assert lease_size(requested=8, limit=4, groups_per_second=None, target_seconds=1.0) == 4
    assert lease_size(requested=3, limit=16, groups_per_second=None, target_seconds=1.0) == 3


def test_lease_is_what_the_actor_finishes_in_the_target_time():
    # 2.5 groups/s for 2 s: 5 groups.
    assert lease_size(requested=16, limit=16, groups_per_second=2.5, target_seconds=2.0) == 5


def test_faster_actors_get_more_groups_in_proportion_to_their_speed():
    slow = lease_size(requested=64, limit=64, groups_per_second=1.0, target_seconds=4.0)
    fast = lease_size(requested=64, limit=64, groups_per_second=6.0, target_seconds=4.0)
    assert (slow, fast) == (4, 24)


def test_a_very_slow_actor_still_gets_one_group():
    assert lease_size(requested=8, limit=8, groups_per_second=0.01, target_seconds=1.0) == 1


@pytest.mark.parametrize("requested, limit", [(0, 8), (8, 0), (-1, 4)])
def test_no_lease_without_room_or_without_a_request(requested, limit):
    assert lease_size(requested=requested, limit=limit, groups_per_second=100.0, target_seconds=1.0) == 0


def test_no_target_yet_means_no_speed_bound():
    assert lease_size(requested=8, limit=6, groups_per_second=0.1, target_seconds=None) == 6


def test_default_target_is_max_staleness_learner_steps():
    assert lease_target_seconds(None, max_staleness=2, step_interval=0.5, lease_seconds=60.0) == 1.0
    # On-policy runs (max_staleness 0) still allow one step.
    assert lease_target_seconds(None, max_staleness=0, step_interval=0.5, lease_seconds=60.0) == 0.5


def test_target_is_unknown_before_the_first_steps_unless_fixed():
    assert lease_target_seconds(None, max_staleness=2, step_interval=None, lease_seconds=60.0) is None
    assert lease_target_seconds(3.0, max_staleness=2, step_interval=None, lease_seconds=60.0) == 3.0


def test_target_stays_well_inside_the_lease_deadline():
    assert lease_target_seconds(None, max_staleness=4, step_interval=30.0, lease_seconds=60.0) == DEADLINE_SHARE * 60.0
    assert lease_target_seconds(100.0, max_staleness=2, step_interval=None, lease_seconds=60.0) == DEADLINE_SHARE * 60.0


# ---------------------------------------------------------------- the Leasing room


def _leasing(clock, sessions=lambda key: [], keys=lambda: 1, **server) -> Leasing:
    cfg = RunConfig.model_validate({"grpo": {"groups_per_step": 2}, "server": server})
    state = LearnerState(run_id="run", incarnation="a" * 12, steps_target=10,
                         scheduler=PromptScheduler(20, seed=0, lease_seconds=cfg.server.lease_seconds, clock=clock))
    prompts = [np.array([i], dtype=np.int32) for i in range(20)]
    return Leasing(cfg, state, learner_metrics(), prompts, [Example(prompt=f"p{i}", answer=str(i)) for i in range(len(prompts))],
                   sessions, keys)


def _actor(key: str = "key") -> ActorInfo:
    return ActorInfo(actor_id="a", host="h", backend="cpu", principal=key, last_seen=0.0)


def _held_after_asking(leasing: Leasing, actor: ActorInfo, times: int = 20) -> int:
    for _ in range(times):
        leasing.grant(actor, m.LeaseRequest(max_groups=4))
    return leasing.state.scheduler.ledger.groups_held(actor.principal)


def _capped(leasing: Leasing, reason: str = "actor_cap") -> float:
    value = leasing.metrics.registry.get_sample_value("grpo_fleet_learner_fair_share_refusals_total",
                                                      {"reason": reason})
    return value or 0.0


def test_an_actor_that_never_returns_its_leases_cannot_take_the_whole_in_flight_budget(clock):
    """Issue 29: lease hoarding. A new actor holds at most NEW_ACTOR_LEASES leases until it is measured."""
    leasing = _leasing(clock, in_flight_steps=8, max_groups_per_lease=2)  # 16 groups in flight
    hoarder, honest = _actor("hoarder"), _actor("honest")
    assert _held_after_asking(leasing, hoarder) == NEW_ACTOR_LEASES * 2
    assert _capped(leasing) > 0
    assert _held_after_asking(leasing, honest, times=1) == 2  # the rest of the budget is still there for others


def test_a_measured_actor_holds_what_it_finishes_within_a_lease_timeout(clock):
    leasing = _leasing(clock, in_flight_steps=20, max_groups_per_lease=4, lease_seconds=10.0)
    fast, slow = _actor("fast"), _actor("slow")
    fast.groups_per_second.add(1.25)  # 12.5 groups in 10 s
    slow.groups_per_second.add(0.01)  # not one: it still gets one at a time
    assert _held_after_asking(leasing, fast) == 12
    assert _held_after_asking(leasing, slow) == 1


def test_the_cap_of_a_key_is_the_sum_of_its_sessions(clock):
    sessions = [_actor("shared"), _actor("shared")]
    leasing = _leasing(clock, sessions=lambda key: sessions if key == "shared" else [],
                       in_flight_steps=20, max_groups_per_lease=2)
    assert _held_after_asking(leasing, sessions[0]) == 2 * NEW_ACTOR_LEASES * 2


def test_in_flight_work_is_capped_at_in_flight_steps_batches(clock):
    leasing = _leasing(clock, in_flight_steps=3, max_groups_per_lease=16)
    actor = _actor()
    assert leasing.capacity() == 3 * 2
    lease = leasing.grant(actor, m.LeaseRequest(max_groups=16))
    assert len(lease.prompts) == 6 and lease.prompts[0].fields == {"answer": str(lease.prompts[0].prompt_index)}
    refused = leasing.grant(actor, m.LeaseRequest(max_groups=1))
    assert refused.lease_id == "" and refused.retry_after == MAX_RETRY_SECONDS


def test_buffered_groups_count_against_the_cap_until_trained(clock):
    leasing = _leasing(clock)  # the default: two steps' worth
    leasing.state.buffer = [object()] * 3  # type: ignore[list-item]
    assert leasing.capacity() == 1
    assert len(leasing.grant(_actor(), m.LeaseRequest(max_groups=4)).prompts) == 1


def test_no_lease_once_the_run_is_done(clock):
    leasing = _leasing(clock)
    leasing.state.step = leasing.state.steps_target
    assert leasing.grant(_actor(), m.LeaseRequest(max_groups=1)).prompts == []


def test_a_refused_actor_retries_about_half_a_step_later():
    assert retry_after(None, done=False) == MAX_RETRY_SECONDS
    assert retry_after(0.04, done=False) == pytest.approx(0.02)
    assert retry_after(0.001, done=False) == MIN_RETRY_SECONDS
    assert retry_after(0.04, done=True) == MAX_RETRY_SECONDS


def test_a_returned_lease_measures_its_actor(clock):
    leasing = _leasing(clock)
    actor = _actor()
    lease = leasing.grant(actor, m.LeaseRequest(max_groups=2))
    clock.advance(0.5)
    leasing.measure(actor, leasing.issued_at(lease.lease_id), 2, 2)
    assert actor.groups_per_second.value == pytest.approx(4.0) and actor.last_return == clock()


def test_expired_leases_are_counted(clock):
    leasing = _leasing(clock)
    leasing.grant(_actor(), m.LeaseRequest(max_groups=2))
    clock.advance(leasing.server.lease_seconds + 1)
    assert leasing.expire() == 1 and leasing.state.scheduler.outstanding_groups == 0


def test_a_late_lease_measures_its_actor_so_the_next_lease_fits_the_deadline(clock):
    """Issue 38: an unmeasured actor's leases of long answers expired one after another; the late one measures."""
    leasing = _leasing(clock)
    actor = _actor()
    lease = leasing.grant(actor, m.LeaseRequest(max_groups=4))
    clock.advance(leasing.server.lease_seconds * 2)
    assert leasing.expire() == 1
    leasing.measure(actor, leasing.issued_at(lease.lease_id), 4, 4)
    assert actor.groups_per_second.value == pytest.approx(4 / (leasing.server.lease_seconds * 2))


def test_a_lease_past_its_deadline_is_extended_while_its_actor_works_up_to_the_cap(clock):
    """Issue 38: long answers outlived their leases while their actors were decoding them."""
    leasing = _leasing(clock, lease_seconds=10.0, max_lease_seconds=25.0)
    working, gone = _actor("working"), _actor("gone")
    kept = leasing.grant(working, m.LeaseRequest(max_groups=1))
    lost = leasing.grant(gone, m.LeaseRequest(max_groups=1))
    scheduler = leasing.state.scheduler
    clock.advance(10.0)
    assert leasing.expire(lambda key: key == "working") == 1, "only the silent actor's lease goes back"
    assert scheduler.ledger.leases[kept.lease_id].deadline == clock() + 10.0 and lost.lease_id not in scheduler.ledger.leases
    clock.advance(10.0)
    assert leasing.expire(lambda key: True) == 0 and scheduler.ledger.leases[kept.lease_id].deadline == clock() + 5.0
    clock.advance(5.0)  # 25 s after it was issued: a hoarder holds it no longer
    assert leasing.expire(lambda key: True) == 1 and scheduler.outstanding_groups == 0


def test_a_lease_is_never_extended_when_max_lease_seconds_is_lease_seconds(clock):
    leasing = _leasing(clock, lease_seconds=10.0, max_lease_seconds=10.0)
    leasing.grant(_actor(), m.LeaseRequest(max_groups=1))
    clock.advance(10.0)
    assert leasing.expire(lambda key: True) == 1


# ---------------------------------------------------------------- one key, hostile but allowed (issue 39 item 2)


def test_a_key_holds_at_most_its_fair_share_plus_one_lease_whatever_speed_and_sessions_it_shows(clock):
    """Its cap was speed x lease_seconds summed over up to max_actors sessions: two instant returns read as
    4,000 groups/s, and one key took the whole in-flight budget."""
    hostile = [_actor("hostile") for _ in range(8)]
    for session in hostile:
        session.groups_per_second.add(4000.0)
    leasing = _leasing(clock, sessions=lambda key: hostile if key == "hostile" else [], keys=lambda: 2,
                       in_flight_steps=8, max_groups_per_lease=2)  # 16 groups in flight, shared by 2 keys
    share = key_share(16, 2, 2)
    assert share == 16 // 2 + 2
    assert _held_after_asking(leasing, hostile[0]) == share
    assert _capped(leasing, "fair_share") > 0
    honest = _actor("honest")
    honest.groups_per_second.add(100.0)
    assert _held_after_asking(leasing, honest) == 16 - share, "the rest is the other key's"


def test_a_lone_key_has_the_whole_budget():
    assert key_share(16, 1, 2) >= 16 and key_share(16, 0, 2) >= 16
    assert key_share(3, 8, 4) == 4, "more keys than groups: still one lease each"


def test_a_return_reads_no_faster_than_its_credible_time_nor_its_growth_allows():
    assert speed_sample(2, 0.0005, None) == pytest.approx(2 / MIN_MEASURED_SECONDS), "no 1 ms floor: 4,000 groups/s"
    assert speed_sample(4, 1.0, 1.0) == pytest.approx(MAX_SPEEDUP * 1.0)
    assert speed_sample(1, 2.0, 1.0) == pytest.approx(0.5), "slowing down is never capped"
    assert speed_sample(0, 0.001, 3.0) == 0.0
    assert speed_sample(4, 1.0, 0.0) == pytest.approx(MAX_SPEEDUP * SPEEDUP_BASE), "a measure at 0 climbs again"


def test_returns_with_nothing_accepted_only_slow_the_measure(clock):
    leasing = _leasing(clock)
    actor = _actor()

    def returned(seconds: float, accepted: int) -> None:
        lease = leasing.state.scheduler.issue(actor.principal, 2)
        clock.advance(seconds)
        leasing.measure(actor, leasing.issued_at(lease.lease_id), accepted, 2)

    returned(0.0005, 0)
    returned(0.0005, 0)
    unmeasured = unmeasured_speed(leasing.server.lease_seconds, leasing.server.max_groups_per_lease)
    assert actor.groups_per_second.value == pytest.approx(unmeasured), "instant unscored returns gain nothing"
    assert actor_cap(unmeasured, leasing.server.lease_seconds, leasing.server.max_groups_per_lease) \
        == actor_cap(None, leasing.server.lease_seconds, leasing.server.max_groups_per_lease)
    actor.groups_per_second.value = None
    returned(1.0, 2)
    assert actor.groups_per_second.value == pytest.approx(2.0)
    returned(0.0005, 0)
    assert actor.groups_per_second.value == pytest.approx(2.0), "nor do they raise a measure"
    returned(10.0, 0)
    assert actor.groups_per_second.value < 2.0, "a slow one lowers it: its leases shrink"
