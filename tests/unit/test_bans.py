"""The ban policy (learner/fleet/bans.py): counted per key, timed, bounded."""

from __future__ import annotations

from grpo_fleet.learner.fleet.bans import Bans, peer_key


def test_a_key_is_banned_at_the_limit_and_only_that_key(clock):
    bans = Bans(max_violations=3, ban_seconds=60, clock=clock)
    assert [bans.record("pest") for _ in range(3)] == [False, False, True]
    assert bans.is_banned("pest")
    assert not bans.is_banned("honest") and bans.violations("honest") == 0
    assert bans.banned_count() == 1


def test_a_ban_runs_out_and_the_count_starts_again(clock):
    bans = Bans(max_violations=2, ban_seconds=60, clock=clock)
    bans.record("pest")
    bans.record("pest")
    clock.advance(59.9)
    assert bans.is_banned("pest")
    clock.advance(0.2)
    assert not bans.is_banned("pest") and bans.banned_count() == 0
    assert bans.record("pest") is False, "one violation after the ban is a fresh start"
    assert bans.violations("pest") == 1


def test_throwaway_identities_cannot_grow_memory(clock):
    bans = Bans(max_violations=5, ban_seconds=60, max_tracked=100, clock=clock)
    for i in range(10_000):
        bans.record(f"throwaway-{i}")
    assert len(bans) == 100
    assert bans.violations("throwaway-9999") == 1 and bans.violations("throwaway-0") == 0


def test_the_ban_follows_the_curve_key_when_there_is_one():
    assert peer_key(b"actor-1", "Z85PUBLICKEY") == "Z85PUBLICKEY"
    assert peer_key(b"actor-1", None) == b"actor-1".hex()
