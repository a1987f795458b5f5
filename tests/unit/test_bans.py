"""The ban policy (learner/actors/bans.py): counted per key, timed, escalating, saved, bounded."""

from __future__ import annotations

from grpo_fleet.learner.actors.bans import Bans, peer_key


def test_a_key_is_banned_at_the_limit_and_only_that_key(clock):
    bans = Bans(max_violations=3, ban_seconds=60, clock=clock)
    assert [bans.record("pest") for _ in range(3)] == [False, False, True]
    assert bans.is_banned("pest")
    assert not bans.is_banned("honest") and bans.violations("honest") == 0
    assert bans.banned_count() == 1


def test_a_ban_runs_out_and_the_key_is_on_its_last_warning(clock):
    bans = Bans(max_violations=2, ban_seconds=60, clock=clock)
    bans.record("pest")
    bans.record("pest")
    clock.advance(59.9)
    assert bans.is_banned("pest")
    clock.advance(0.2)
    assert not bans.is_banned("pest") and bans.banned_count() == 0 and bans.times_banned("pest") == 1
    assert bans.record("pest") is True, "banned before: one violation bans it again"
    assert bans.violations("pest") == 1 and bans.times_banned("pest") == 2


def test_each_later_ban_of_a_key_lasts_twice_the_one_before(clock):
    bans = Bans(max_violations=50, ban_seconds=600, clock=clock)
    lengths = []
    for _ in range(5):
        assert bans.record("liar", 50) is True
        started = clock()
        while bans.is_banned("liar"):
            clock.advance(1.0)
        lengths.append(clock() - started)
    assert lengths == [600.0, 1200.0, 2400.0, 4800.0, 9600.0]
    assert bans.length(10_000) == 600 * 2.0 ** 16, "capped, so the end stays a finite time"


def test_bans_and_ban_counts_survive_export_and_load_and_downtime_counts(clock):
    bans = Bans(max_violations=3, ban_seconds=600, clock=clock)
    bans.record("liar", 3)  # banned until 600
    bans.record("old-liar", 3)
    clock.advance(700)  # old-liar's first ban (600 s) ran out; liar was banned again just now
    bans.record("liar")
    bans.record("pest")  # one violation, no ban
    saved = bans.export(wall=1_000_000.0)
    later = Bans(max_violations=3, ban_seconds=600, clock=clock)
    later.load(saved, wall=1_000_000.0 + 1000)  # the learner was down for 1,000 s of liar's 1,200 s ban
    assert later.is_banned("liar") and later.times_banned("liar") == 2
    clock.advance(199)
    assert later.is_banned("liar")
    clock.advance(2)
    assert not later.is_banned("liar")
    assert not later.is_banned("old-liar") and later.times_banned("old-liar") == 1
    assert later.record("old-liar") is True, "its ban count survived the resume: one violation bans it again"
    assert later.violations("pest") == 1 and later.times_banned("pest") == 0
    assert later.export(wall=5.0).keys() == saved.keys()


def test_throwaway_identities_cannot_grow_memory(clock):
    bans = Bans(max_violations=5, ban_seconds=60, max_tracked=100, clock=clock)
    for i in range(10_000):
        bans.record(f"throwaway-{i}")
    assert len(bans) == 100
    assert bans.violations("throwaway-9999") == 1 and bans.violations("throwaway-0") == 0


def test_throwaway_identities_cannot_push_a_banned_key_out(clock):
    bans = Bans(max_violations=5, ban_seconds=60, max_tracked=100, clock=clock)
    bans.record("liar", 5)
    for i in range(10_000):
        bans.record(f"throwaway-{i}")
    assert len(bans) == 100 and bans.is_banned("liar") and bans.times_banned("liar") == 1


def test_the_ban_follows_the_curve_key_when_there_is_one():
    assert peer_key(b"actor-1", "Z85PUBLICKEY") == "Z85PUBLICKEY"
    assert peer_key(b"actor-1", None) == b"actor-1".hex()
