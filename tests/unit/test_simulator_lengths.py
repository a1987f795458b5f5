"""The fleet simulator at drawn completion lengths: the draw, refilled decode rows, padding and staleness."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from grpo_fleet.simulator.decoding import decode_batch
from grpo_fleet.simulator.lengths import LengthSpec, parse_lengths
from grpo_fleet.simulator.plan import PlanInputs, PlanShape, plan_lengths
from grpo_fleet.simulator.simulation import percentile, simulate
from grpo_fleet.simulator.specs import ActorSpec, CheckSpec, FleetRules, RunSpec

SPREAD = LengthSpec("lognormal", 512, low=16, median=200, sigma=1.0)


def test_lengths_are_drawn_as_specified_and_held_within_their_bounds():
    draw = random.Random(1)
    uniform = LengthSpec("uniform", 512, low=16).sample(draw, 20_000)
    assert min(uniform) == 16 and max(uniform) == 512
    assert statistics.mean(uniform) == pytest.approx((16 + 512) / 2, rel=0.01)
    # Unclipped, a lognormal's median is its median and log(length) has its sigma.
    wide = LengthSpec("lognormal", 10**6, low=1, median=300, sigma=0.6).sample(draw, 20_000)
    assert statistics.median(wide) == pytest.approx(300, rel=0.03)
    assert statistics.stdev(math.log(x) for x in wide) == pytest.approx(0.6, rel=0.03)
    clipped = SPREAD.sample(draw, 20_000)
    assert min(clipped) == 16 and max(clipped) == 512
    assert clipped.count(512) / len(clipped) == pytest.approx(0.5 - 0.5 * math.erf(math.log(512 / 200) / math.sqrt(2)),
                                                             abs=0.01), "the tail past max_tokens is cut off there"
    assert LengthSpec("fixed", 384).sample(draw, 5) == [384] * 5
    assert SPREAD.sample(random.Random(7), 50) == SPREAD.sample(random.Random(7), 50), "seeded: a run repeats"


def test_length_distributions_parse_from_the_command_line_form():
    assert parse_lengths("fixed", 512) == LengthSpec("fixed", 512)
    assert parse_lengths("uniform:16", 512) == LengthSpec("uniform", 512, low=16)
    assert parse_lengths("lognormal:300:0.6:16", 512) == LengthSpec("lognormal", 512, low=16, median=300, sigma=0.6)
    for bad in ("gamma:1", "uniform", "uniform:600", "lognormal:300", "lognormal:-1:0.5", "lognormal:a:b"):
        with pytest.raises(ValueError):
            parse_lengths(bad, 512)


def test_a_batch_waits_for_its_longest_row_and_a_refilled_row_is_charged_what_is_left():
    # 4 rows, a step of all four 4 x 0.01 s: the batch takes its longest, 100 steps.
    batch = decode_batch([10, 100, 50, 100], 0.01)
    assert batch.seconds == pytest.approx(100 * 0.04)
    assert batch.useful_seconds == pytest.approx(260 * 0.01)
    assert sorted(batch.head_start) == pytest.approx([0.0, 0.0, 2.0, 3.6])
    # The next batch's completions go in order to the rows free longest: its two 100-token ones start 3.6 s and
    # 2.0 s early, so it ends 2.0 s before a batch started fresh.
    refilled = decode_batch([100, 100, 10, 10], 0.01, batch.head_start)
    assert refilled.seconds == pytest.approx(100 * 0.04 - 2.0)
    assert decode_batch([100, 100, 10, 10], 0.01).seconds == pytest.approx(4.0)
    # A row free 4 s early takes both short completions of the next batch and then a long one (-4 + 0.4 + 0.4 +
    # 4.0: free 3.2 s before the batch ends); two rows stay empty, and one decodes the other long one.
    taken = decode_batch([10, 10, 100, 100], 0.01, (4.0, 0.0, 0.0, 0.0))
    assert taken.seconds == pytest.approx(4.0)
    assert sorted(taken.head_start) == pytest.approx([0.0, 3.2, 4.0, 4.0])


def _simulate(lengths: LengthSpec, refill: bool, actors: int = 1, groups_per_step: int = 8, max_staleness: int = 50,
              **run):
    actor = ActorSpec(0.0, lengths=lengths, token_seconds=0.001, group_size=8, refill=refill)
    rules = FleetRules(groups_per_step=groups_per_step, max_staleness=max_staleness, in_flight_steps=8)
    return simulate([actor] * actors, RunSpec(rules, step_seconds=0.5, prompt_tokens=50, **run))


def test_refilled_rows_idle_less_and_step_sooner_at_spread_lengths_and_change_nothing_at_one_length():
    refilled, static = _simulate(SPREAD, True), _simulate(SPREAD, False)
    assert static.idle_slot_fraction > 0.3 and refilled.idle_slot_fraction < 0.1
    assert refilled.steps_per_second > 1.5 * static.steps_per_second
    assert refilled.rollout_tokens_per_second > 1.5 * static.rollout_tokens_per_second
    fixed = LengthSpec("fixed", 300)
    assert _simulate(fixed, True) == _simulate(fixed, False)
    assert _simulate(fixed, True).idle_slot_fraction == 0.0


def test_a_refilling_actor_keeps_its_loaded_weights_only_as_far_as_the_staleness_bound_allows():
    # One actor, 2 groups a step: the learner steps every lease or so. A batch that never empties keeps
    # sampling at its loaded weights while may_refill allows; at max_staleness 1 it drains at every new version.
    strict, loose = (_simulate(SPREAD, True, groups_per_step=2, max_staleness=bound) for bound in (1, 50))
    static = _simulate(SPREAD, False, groups_per_step=2, max_staleness=50)
    assert loose.arrival_staleness > 10 * static.arrival_staleness
    assert loose.idle_slot_fraction < 0.1 < 0.4 < strict.idle_slot_fraction
    assert loose.steps_per_second > 1.5 * strict.steps_per_second


def test_drawn_lengths_at_one_length_are_the_old_fixed_cost_a_group():
    # 8 completions of 300 tokens at 1 ms a token: 2.4 s a group, as the old model's seconds_per_group.
    rules = FleetRules(groups_per_step=4, max_staleness=1, in_flight_steps=4)
    run = RunSpec(rules, step_seconds=1.5, check=CheckSpec(forward_seconds=0.3, probation_groups=2, share=0.5))
    drawn = ActorSpec(0.0, fetch_seconds=0.2, lengths=LengthSpec("fixed", 300), token_seconds=0.001, group_size=8)
    old = ActorSpec(2.4, fetch_seconds=0.2)
    slow = [ActorSpec(9.0, max_groups=1)]
    new_result, old_result = simulate([drawn] * 3 + slow, run), simulate([old] * 3 + slow, run)
    assert old_result.stale_fraction > 0.0, "the slow actor's groups arrive too stale: a case with every rule at work"
    for name in ("steps_per_second", "learner_busy_fraction", "actor_busy_fraction", "stale_fraction",
                 "mean_staleness", "forward_fraction", "staleness_p90", "arrival_staleness"):
        assert getattr(new_result, name) == pytest.approx(getattr(old_result, name), rel=1e-9), name


def test_a_wider_spread_makes_a_batch_wait_longer_and_the_tail_of_groups_older():
    narrow = LengthSpec("lognormal", 2048, low=16, median=200, sigma=0.2)
    wide = replace(narrow, sigma=1.0)
    # 8 actors of one group a lease, 2 groups a step: each lease spans several steps.
    few, many = (_simulate(lengths, False, actors=8, groups_per_step=2) for lengths in (narrow, wide))
    assert 1 / many.steps_per_second > 2 * (1 / few.steps_per_second)
    assert many.staleness_p90 > few.staleness_p90


def test_the_learner_pays_its_padding_only_when_lengths_spread():
    # Plenty of actors: the learner sets the pace, 0.5 s plus 1 ms a trained token.
    padded, packed = (_simulate(SPREAD, True, actors=8, seconds_per_token=0.001, padding=p) for p in (1.0, 0.0))
    assert packed.learner_busy_fraction == pytest.approx(1.0, abs=0.02)
    assert 1 / padded.steps_per_second > 1.3 * (1 / packed.steps_per_second)
    fixed = LengthSpec("fixed", 300)
    one, other = (_simulate(fixed, True, actors=8, seconds_per_token=0.001, padding=p) for p in (1.0, 0.0))
    assert one.steps_per_second == other.steps_per_second
    # 8 groups x 8 rows x (50 + 300) tokens: 22.4 s of tokens plus 0.5 s a step.
    assert 1 / one.steps_per_second == pytest.approx(0.5 + 8 * 8 * 350 * 0.001, rel=0.01)


def test_percentile_is_the_nearest_rank():
    assert percentile([], 0.9) == 0.0
    assert percentile([3, 1, 2, 4, 5, 6, 7, 8, 9, 10], 0.9) == 9.0
    assert percentile([0] * 89 + [1] * 11, 0.9) == 1.0


def test_the_reasoning_plan_has_a_row_per_fleet_with_refill_and_without():
    shape = PlanShape(completion_tokens=512, lengths=LengthSpec("uniform", 512, low=16))
    rows = plan_lengths(PlanInputs(learner_tok_s=2000.0), shape, [1, 4], steps=60)
    assert [(r.actors, r.refill) for r in rows] == [(1, True), (1, False), (4, True), (4, False)]
    one_on, one_off, four_on, _ = (r.result for r in rows)
    assert one_on.steps_per_second > one_off.steps_per_second, "one Mac of actors sets the pace: refill pays"
    assert four_on.steps_per_second > one_on.steps_per_second


def test_the_simulate_command_prints_the_lengths_table_and_refuses_a_bad_distribution(capsys):
    from grpo_fleet.cli.main import main

    argv = ["simulate", "--actors", "1,2", "--ranks", "1", "--learner-tok-s", "2000", "--completion-tokens", "512"]
    assert main(argv + ["--lengths", "lognormal:300:0.6:16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "lognormal (median 300, sigma 0.6) clipped to 16..512" in lines[0]
    assert lines[2].startswith("| Macs of actors | s a step |") and lines[4].startswith("| 1 | ")
    assert len(lines) == 6
    assert main(argv + ["--lengths", "gamma:2"]) == 2
    assert "bad length distribution" in capsys.readouterr().err
