"""The fleet simulator against what its rules imply in the cases that can be worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_fleet.fleetsim.plan import PlanInputs, PlanShape, plan, step_seconds
from grpo_fleet.fleetsim.published import MODELS, learner_tokens_per_second
from grpo_fleet.fleetsim.simulation import ActorSpec, RunSpec, SharedHost, simulate


def test_one_slow_actor_sets_the_pace():
    # 8 groups a step at 4 s a group: 32 s a step whatever the (fast) learner does.
    result = simulate([ActorSpec(seconds_per_group=4.0)], RunSpec(groups_per_step=8, step_seconds=1.0))
    assert result.steps_per_second == pytest.approx(1 / 32, rel=0.02)
    assert result.actor_busy_fraction == pytest.approx(1.0, abs=0.02)
    assert result.stale_fraction == 0.0


def test_plenty_of_fast_actors_leave_the_learner_the_bottleneck():
    actors = [ActorSpec(seconds_per_group=0.1)] * 16
    result = simulate(actors, RunSpec(groups_per_step=8, step_seconds=5.0, in_flight_steps=4))
    assert result.steps_per_second == pytest.approx(1 / 5.0, rel=0.02)
    assert result.learner_busy_fraction == pytest.approx(1.0, abs=0.02)


def test_groups_without_reward_variance_cost_actor_time():
    run = RunSpec(groups_per_step=8, step_seconds=1.0)
    full = simulate([ActorSpec(seconds_per_group=2.0)], run)
    half = simulate([ActorSpec(seconds_per_group=2.0)], RunSpec(groups_per_step=8, step_seconds=1.0,
                                                                 informative_fraction=0.5))
    assert half.steps_per_second == pytest.approx(full.steps_per_second / 2, rel=0.03)


def test_pipelined_leases_hold_the_in_flight_room_and_more_room_lifts_the_cap():
    # Each actor holds its next lease while generating the current one, so at in_flight_steps=2 only about
    # one step's worth of groups is being generated: 8 groups every 8 s although the learner needs 5 s.
    actors = [ActorSpec(seconds_per_group=4.0)] * 8
    capped = simulate(actors, RunSpec(groups_per_step=8, step_seconds=5.0, in_flight_steps=2))
    roomy = simulate(actors, RunSpec(groups_per_step=8, step_seconds=5.0, in_flight_steps=4))
    assert capped.steps_per_second == pytest.approx(1 / 8, rel=0.03)
    assert roomy.steps_per_second == pytest.approx(1 / 5, rel=0.03)


def test_groups_that_arrive_too_stale_are_rejected_and_counted():
    # A slow actor next to fast ones: by the time its 4 s group lands, the learner has moved on.
    actors = [ActorSpec(seconds_per_group=0.05)] * 4 + [ActorSpec(seconds_per_group=4.0, max_groups=1)]
    strict = simulate(actors, RunSpec(groups_per_step=4, step_seconds=0.5, max_staleness=0, in_flight_steps=4))
    lenient = simulate(actors, RunSpec(groups_per_step=4, step_seconds=0.5, max_staleness=50, in_flight_steps=4))
    assert strict.stale_fraction > 0.0
    assert lenient.stale_fraction == 0.0
    # Accepted fresh, then waiting in the buffer: at most max_staleness + in_flight_steps behind when trained.
    assert 0.0 < strict.mean_staleness <= 0 + 4
    assert lenient.mean_staleness > strict.mean_staleness


def test_on_one_shared_core_the_actor_and_the_learner_take_turns():
    # Alone: 2 groups at 1 s generate while the 2 s step runs, so 2 s a step. Each wanting the one core the
    # host has, they halve each other's speed whenever both run: the step's 4 s of work in all, serialised.
    actor, run = [ActorSpec(seconds_per_group=1.0)], RunSpec(groups_per_step=2, step_seconds=2.0, in_flight_steps=4)
    own = simulate(actor, run)
    shared = simulate(actor, run, SharedHost(cores=1.0, learner_cores=1.0, actor_cores=1.0))
    roomy = simulate(actor, run, SharedHost(cores=2.0, learner_cores=1.0, actor_cores=1.0))
    assert own.steps_per_second == pytest.approx(1 / 2.0, rel=0.02)
    assert shared.steps_per_second == pytest.approx(1 / 4.0, rel=0.02)
    assert roomy.steps_per_second == pytest.approx(own.steps_per_second, rel=1e-9)


def test_each_submissions_logprob_check_delays_the_step_that_takes_it():
    # Fast actors delivering 4 groups a lease, every group informative: with 1 check a submission each step
    # waits for one 0.5 s check on the training thread, with 4 for all four of its groups'.
    actors = [ActorSpec(seconds_per_group=0.05, max_groups=4)] * 8
    run = RunSpec(groups_per_step=4, step_seconds=2.0, max_groups_per_lease=4, in_flight_steps=4)
    plain = simulate(actors, run)
    one = simulate(actors, replace(run, logprob_check_seconds=0.5, logprob_checks_per_submission=1))
    every = simulate(actors, replace(run, logprob_check_seconds=0.5, logprob_checks_per_submission=4))
    assert plain.steps_per_second == pytest.approx(1 / 2.0, rel=0.02)
    assert one.steps_per_second == pytest.approx(1 / 2.5, rel=0.03)
    assert every.steps_per_second == pytest.approx(1 / 4.0, rel=0.03)


def test_ranks_split_the_step_and_the_lora_all_reduce_is_small():
    inputs, shape = PlanInputs(model="qwen2.5-0.5b"), PlanShape()
    one, _ = step_seconds(inputs, shape, 1)
    two, _ = step_seconds(inputs, shape, 2)
    assert two == pytest.approx(one / 2, rel=0.01)
    assert two > one / 2  # the ring all-reduce is not free
    assert learner_tokens_per_second(MODELS["qwen2.5-7b"])[1], "7B's learner speed is extrapolated, and says so"


def test_a_faster_learner_needs_more_actors_to_saturate():
    shape = PlanShape(groups_per_step=8)
    counts = [1, 2, 4, 8, 16, 32, 64]
    slow = plan(PlanInputs(learner_tok_s=200.0), shape, counts, [1], steps=60)
    fast = plan(PlanInputs(learner_tok_s=20000.0), shape, counts, [1], steps=60)
    assert slow.saturating_actors[1] < fast.saturating_actors[1]
    steps_per_second = [r.steps_per_second for r in fast.rows]
    assert steps_per_second == sorted(steps_per_second), "more actors never slow the fleet down"


def test_the_logprob_check_stays_on_rank_0_so_ranks_gain_less_with_it():
    shape, counts = PlanShape(groups_per_step=8), [64]
    checked = plan(PlanInputs(learner_tok_s=2000.0), shape, counts, [1, 2], steps=60)
    trusted = plan(PlanInputs(learner_tok_s=2000.0, logprob_check=False), shape, counts, [1, 2], steps=60)
    assert trusted.check_seconds == 0.0 < checked.check_seconds

    def best(result, ranks):
        return max(r.steps_per_second for r in result.rows if r.ranks == ranks)

    assert best(checked, 1) < best(trusted, 1)
    assert best(checked, 2) / best(checked, 1) < best(trusted, 2) / best(trusted, 1)


def test_the_simulate_command_prints_the_plan_and_refuses_unknown_sizes(capsys):
    from grpo_fleet.cli import main

    assert main(["simulate", "--actors", "1,8", "--ranks", "1,2", "--learner-tok-s", "2000"]) == 0
    out = capsys.readouterr().out
    assert "steps/h, 2 ranks" in out and "one learner saturates at" in out and "not a measurement" in out
    assert "logprob check" in out and "a submission, on rank 0" in out
    assert main(["simulate", "--model", "70b"]) == 2
    assert "choose --model from" in capsys.readouterr().err
