"""The rolling generator: leases in one continuous batch, same tokens and logprobs as one lease at a time."""

from __future__ import annotations

from typing import Hashable, Sequence

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.actor.rolling import FinishedLease, RollingGenerator, SlotUsage, WeightsInFlight, may_refill
from grpo_fleet.models.generation import SamplingSettings, encode_prompt, generate_groups
from grpo_fleet.models.loading import load_policy


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir))


def run_leases(generator: RollingGenerator, leases: Sequence[tuple[Hashable, Sequence[Sequence[int]]]],
               version: int = 0) -> list[FinishedLease]:
    """Every lease through `generator`, each queued as soon as it wants work, as the actor's worker feeds it."""
    waiting, finished = list(leases), []
    while waiting or not generator.idle:
        while waiting and generator.wants_work:
            key, prompts = waiting.pop(0)
            generator.add(key, prompts, version)
        finished.extend(generator.step())
    return finished


def _prompts(policy, *texts: str) -> list[list[int]]:
    return [encode_prompt(policy.tokenizer, text, chat_template=False) for text in texts]


def _settings(policy, group_size: int = 3, max_tokens: int = 10, temperature: float = 0.0) -> SamplingSettings:
    return SamplingSettings(group_size=group_size, max_tokens=max_tokens, temperature=temperature,
                            stop_token_ids=sorted(policy.tokenizer.eos_token_ids))


# Long prompts (>= 16 tokens) take the shared-prefix path, short ones the G-copies path.
LEASES = (("123=", "9="), ("0123456789" * 3 + "4=",), ("4567=", "0123456789" * 2 + "98="), ("5=",))


@pytest.mark.parametrize("min_shared_prefix", [16, None])
def test_greedy_leases_match_generate_groups_one_at_a_time(policy, min_shared_prefix):
    # Batch slots fewer than one lease's sequences: leases queue and enter mid-flight as slots free.
    settings = _settings(policy)
    leases = [(i, _prompts(policy, *texts)) for i, texts in enumerate(LEASES)]
    rolling: RollingGenerator[int] = RollingGenerator(policy.model, settings, batch_size=4,
                                                      min_shared_prefix=min_shared_prefix)
    finished = {lease.key: lease for lease in run_leases(rolling, leases, version=7)}
    assert sorted(finished) == [0, 1, 2, 3] and rolling.idle
    for key, prompts in leases:
        alone = generate_groups(policy.model, prompts, settings, min_shared_prefix=min_shared_prefix)
        got = finished[key]
        assert got.version == 7 and [len(g) for g in got.groups] == [settings.group_size] * len(prompts)
        for ours, theirs in zip(got.groups, alone):
            assert [c.tokens for c in ours] == [c.tokens for c in theirs]
            assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
            for a, b in zip(ours, theirs):
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_lease_added_mid_flight_finishes_with_its_own_groups(policy):
    # Sampled: every completion differs, so a mixed-up group would show. No stop tokens: lengths are max_tokens.
    mx.random.seed(4)
    settings = SamplingSettings(group_size=4, max_tokens=12, temperature=1.0)
    rolling: RollingGenerator[str] = RollingGenerator(policy.model, settings, batch_size=8)
    first, second = _prompts(policy, "0123456789" * 3 + "1=", "22="), _prompts(policy, "0123456789" * 2 + "7=")
    rolling.add("first", first, version=0)
    for _ in range(5):
        assert rolling.step() == []
    assert rolling.wants_work and rolling.in_flight == 8
    rolling.add("second", second, version=0)
    done = []
    while not rolling.idle:
        done.extend(rolling.step())
    assert [lease.key for lease in done] == ["first", "second"]
    for lease, prompts in zip(done, (first, second)):
        assert len(lease.groups) == len(prompts)
        for group in lease.groups:
            assert len(group) == 4 and all(len(c.tokens) == 12 and len(c.logprobs) == 12 for c in group)
            assert len({tuple(c.tokens) for c in group}) > 1
    # The second lease queued behind 8 busy slots and took them the step after they freed: no step lost.
    assert (rolling.usage.steps, rolling.usage.rows) == (12 + 12, 8 * 12 + 4 * 12)


def test_no_lease_at_another_version_while_sequences_are_in_flight(policy):
    rolling: RollingGenerator[str] = RollingGenerator(policy.model, _settings(policy), batch_size=8)
    rolling.add("a", _prompts(policy, "123="), version=3)
    rolling.step()
    with pytest.raises(WeightsInFlight):
        rolling.add("b", _prompts(policy, "45="), version=4)
    rolling.add("c", _prompts(policy, "45="), version=3)  # the same version still joins
    done = []
    while not rolling.idle:
        done.extend(rolling.step())
    assert {(lease.key, lease.version) for lease in done} == {("a", 3), ("c", 3)}
    rolling.add("b", _prompts(policy, "45="), version=4)  # empty now: the weights could have been swapped
    done = run_leases(rolling, [])
    assert [(lease.key, lease.version) for lease in done] == [("b", 4)]


def test_slot_usage_counts_idle_rows():
    usage = SlotUsage(batch_size=4)
    assert usage.idle_fraction == 0.0
    for rows in (4, 4, 2, 1):
        usage.count(rows)
    assert usage.idle_slots == 5 and usage.idle_fraction == pytest.approx(5 / 16)


def test_back_to_back_leases_leave_no_slot_idle(policy):
    # Each lease fills the 4 slots for 12 steps (no stop tokens): the next one must take them the step after.
    # Shared-prefix prompts (>= 16 tokens) join the batch with no prefill step of their own.
    settings = SamplingSettings(group_size=2, max_tokens=12, temperature=1.0)
    rolling: RollingGenerator[int] = RollingGenerator(policy.model, settings, batch_size=4)
    run_leases(rolling, [(i, _prompts(policy, "0123456789" * 2 + "1=", "0123456789" * 2 + "2=")) for i in range(6)])
    assert (rolling.usage.steps, rolling.usage.rows, rolling.usage.idle_fraction) == (6 * 12, 6 * 4 * 12, 0.0)


@pytest.mark.parametrize(("loaded", "newest", "max_staleness", "allowed"), [
    (3, 3, 2, True), (3, 4, 2, False), (3, 3, None, True), (3, 4, None, False), (3, 4, 0, False),
    (3, 5, 4, True), (3, 6, 4, False), (5, 4, 2, False), (-1, -1, 2, False),
])
def test_new_work_starts_only_while_two_more_steps_stay_within_the_bound(loaded, newest, max_staleness, allowed):
    assert may_refill(loaded, newest, max_staleness) is allowed
