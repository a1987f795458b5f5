"""Tests for grpo_fleet.learner.actors.registry: who is connected, under which key, how fast, and who is banned."""

from __future__ import annotations

import pytest

from grpo_fleet.config import ServerConfig
from grpo_fleet.learner.actors.registry import Registry, RunCard, is_silent
from grpo_fleet.learner.records import actor_ids
from grpo_fleet.learner.records.actor_ids import MAX_BOUND_IDS
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.persistence import capture, restore, state_from_dict, state_to_dict
from grpo_fleet.learner.records.runlog import LogSizes
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import messages as m


def _hello(actor_id: str = "a", metrics_port: int = 0) -> m.Hello:
    return m.Hello(actor_id=actor_id, host="mac", backend="cpu", versions={}, metrics_port=metrics_port)


@pytest.fixture
def registry() -> Registry:
    return Registry(ServerConfig(max_actors=2, max_violations=2), learner_metrics())


def _sample(registry: Registry, name: str, labels: dict | None = None) -> float:
    return registry.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_hello_registers_and_known_checks_identity_and_key(registry):
    assert registry.hello(b"id-a", "key-a", _hello(), "10.0.0.5") is None
    assert registry.known(b"id-a", "key-a").actor_id == "a"
    assert registry.known(b"id-a", "other-key") is None, "a routing id alone does not make one an actor"
    assert registry.known(b"id-b", "key-a") is None
    assert _sample(registry, "grpo_fleet_learner_protocol_errors_total", {"reason": "not_registered"}) == 2
    assert _sample(registry, "grpo_fleet_learner_actors_connected") == 1


def test_a_full_registry_refuses_newcomers_but_not_known_actors(registry):
    registry.hello(b"one", "k1", _hello("one"), "")
    registry.hello(b"two", "k2", _hello("two"), "")
    refusal = registry.hello(b"three", "k3", _hello("three"), "")
    assert isinstance(refusal, m.ErrorReply) and refusal.reason == "too_many_actors"
    assert registry.hello(b"two", "k2", _hello("two"), "") is None
    assert registry.drop(b"one").actor_id == "one" and registry.drop(b"one") is None
    assert registry.hello(b"three", "k3", _hello("three"), "") is None


def test_sessions_count_live_identities_per_key(registry):
    registry.hello(b"mac-1", "shared", _hello("m1"), "")
    registry.hello(b"mac-2", "shared", _hello("m2"), "")
    assert registry.sessions("shared") == 2 and registry.sessions("nobody") == 0


def test_violations_ban_a_key_after_max_violations(registry):
    registry.record_violation("pest", "malformed")
    assert not registry.is_banned("pest")
    registry.record_violation("pest", "malformed")
    assert registry.is_banned("pest")
    assert _sample(registry, "grpo_fleet_learner_bans_total") == 1
    assert _sample(registry, "grpo_fleet_learner_violations_total", {"reason": "malformed"}) == 2


def test_credit_and_status_report_throughput(registry):
    registry.hello(b"id", "key", _hello(), "")
    actor = registry.actors[b"id"]
    registry.credit(actor, tokens=120, version=3)
    state = LearnerState(run_id="run", incarnation="a" * 12, steps_target=9, step=4, version=3,
                         scheduler=PromptScheduler(1, seed=0, lease_seconds=1.0))
    status = registry.status(state)
    assert (status.step, status.steps_target, status.policy_version, status.groups_accepted) == (4, 9, 3, 1)
    assert status.tokens_per_second > 0 and status.actors[0].policy_version == 3


def test_service_discovery_lists_the_learner_and_actors_with_a_metrics_port(registry):
    registry.hello(b"a", "ka", _hello("a", metrics_port=9401), "10.0.0.5")
    registry.hello(b"b", "kb", _hello("b"), "10.0.0.6")
    registry.refresh_service_discovery("learner:9400")
    assert registry.sd_snapshot == [
        {"targets": ["learner:9400"], "labels": {"role": "learner"}},
        {"targets": ["10.0.0.5:9401"], "labels": {"role": "actor", "actor": "a"}},
    ]


def test_the_run_card_welcomes_with_the_current_version_and_incarnation():
    card = RunCard(
        model=m.ModelRef(path="tiny", digest="d" * 64, dtype="float32"),
        generation=m.GenerationParams(group_size=4, max_tokens=8, temperature=1.0, top_p=1.0),
        reward=m.RewardSpec(names=["r"], weights=[1.0]), heartbeat_seconds=2.0, vocab_size=64,
    )
    state = LearnerState(run_id="run", incarnation="b" * 12, steps_target=9, version=5,
                         scheduler=PromptScheduler(1, seed=0, lease_seconds=1.0))
    welcome = card.welcome("worker-1", state, "tcp://h:5556")
    assert (welcome.actor_id, welcome.run_id, welcome.policy_version) == ("worker-1", "run", 5)
    assert (welcome.incarnation, welcome.pub_address, welcome.vocab_size) == ("b" * 12, "tcp://h:5556", 64)


# ---------------------------------------------------------------- actor ids bound to the key that first used them


def _state() -> LearnerState:
    return LearnerState(run_id="run", incarnation="a" * 12, steps_target=1,
                        scheduler=PromptScheduler(3, seed=0, lease_seconds=60.0))


def test_another_key_cannot_take_over_an_actor_id():
    """Issue 29: any allowed key could say Hello under another actor's id (or routing id) and take it over."""
    state = _state()
    registry = Registry(ServerConfig(), learner_metrics(), ids=state.actor_ids)
    assert registry.hello(b"mac-1", "key-1", _hello("mac-1"), "") is None
    for identity, actor_id in ((b"mac-1", "mac-1"), (b"mac-1", "other"), (b"other", "mac-1")):
        refusal = registry.hello(identity, "key-2", _hello(actor_id), "")
        assert isinstance(refusal, m.ErrorReply) and refusal.reason == "id_taken", (identity, actor_id)
        assert "mac-1" in refusal.detail
    assert registry.actors[b"mac-1"].principal == "key-1" and list(registry.actors) == [b"mac-1"]
    assert _sample(registry, "grpo_fleet_learner_auth_failures_total", {"reason": "id_taken"}) == 3
    assert registry.bans.violations("key-2") == 0  # a clash of ids at Hello is refused, not charged as hostile
    # Requests on the actor's connection under the other key (a ROUTER_HANDOVER takeover) are, and counted.
    assert registry.known(b"mac-1", "key-2") is None
    assert registry.bans.violations("key-2") == 1
    assert _sample(registry, "grpo_fleet_learner_auth_failures_total", {"reason": "id_taken"}) == 4
    # The same actor restarted with its own key gets its id back, even after it was dropped.
    registry.drop(b"mac-1")
    assert registry.hello(b"mac-1", "key-1", _hello("mac-1"), "") is None
    assert registry.hello(b"mac-2", "key-2", _hello("mac-2"), "") is None  # the other key under an id of its own


def test_the_bindings_survive_a_resume():
    state = _state()
    Registry(ServerConfig(), learner_metrics(), ids=state.actor_ids).hello(b"mac-1", "key-1", _hello("mac-1"), "")
    resumed = _state()
    restore(resumed, state_from_dict(state_to_dict(capture(state, LogSizes(0, 0)))))
    registry = Registry(ServerConfig(), learner_metrics(), ids=resumed.actor_ids)
    assert registry.hello(b"mac-1", "key-2", _hello("mac-1"), "").reason == "id_taken"
    assert registry.hello(b"mac-1", "key-1", _hello("mac-1"), "") is None


def test_bound_ids_are_bounded_forgetting_the_oldest_not_in_use(monkeypatch):
    monkeypatch.setattr(actor_ids, "MAX_BOUND_IDS", 3)
    registry = Registry(ServerConfig(max_actors=8), learner_metrics())
    for name in ("live", "gone-1", "gone-2"):
        assert registry.hello(name.encode(), f"key-{name}", _hello(name), "") is None
    for name in ("gone-1", "gone-2"):
        registry.drop(name.encode())  # restarted under a new id (host-pid), never to come back
    assert registry.hello(b"new-1", "key-new", _hello("new-1"), "") is None
    assert registry.ids.owner("gone-1") is None and registry.ids.owner("live") == "key-live"
    assert registry.hello(b"new-2", "key-new", _hello("new-2"), "") is None
    assert registry.ids.owner("gone-2") is None
    # Every bound id is in use now: a Hello under yet another id is refused, and nothing is forgotten.
    refusal = registry.hello(b"new-3", "key-new", _hello("new-3"), "")
    assert refusal is not None and refusal.reason == "too_many_ids"
    assert sorted(registry.ids.bindings()) == ["live", "new-1", "new-2"]


def test_a_flood_of_new_ids_from_one_key_never_frees_another_keys_id():
    """Issue 39 item 5: 4,096 Hellos under new ids from one key evicted the oldest bindings not in use, an honest
    actor's among them (right after a resume, or while it restarts), and the flooding key then took that id."""
    state = _state()
    registry = Registry(ServerConfig(), learner_metrics(), ids=state.actor_ids)
    assert registry.hello(b"mac-1", "honest", _hello("mac-1"), "") is None
    registry.drop(b"mac-1")  # restarting: its id is bound, not in use
    for serial in range(MAX_BOUND_IDS + 100):
        assert registry.hello(b"flood", "hostile", _hello(f"flood-{serial}"), "") is None
    assert registry.ids.owner("mac-1") == "honest"
    assert sum(owner == "hostile" for owner in registry.ids.bindings().values()) == registry.ids_per_key
    assert registry.hello(b"flood", "hostile", _hello("mac-1"), "").reason == "id_taken"
    assert registry.hello(b"mac-1", "honest", _hello("mac-1"), "") is None, "the honest actor gets its id back"


def test_a_key_whose_every_bound_id_is_in_use_is_refused_and_nothing_is_forgotten():
    ids = actor_ids.ActorIds()
    for serial in range(2):
        assert ids.claim([f"live-{serial}"], "key", lambda name: True, per_key=2) is None
    assert ids.claim(["new"], "key", lambda name: True, per_key=2) == "new"
    assert ids.claim(["other"], "other-key", lambda name: True, per_key=2) is None, "the cap is per key"
    assert sorted(ids.bindings()) == ["live-0", "live-1", "other"]
    assert ids.claim(["new"], "key", lambda name: name != "live-0", per_key=2) is None
    assert sorted(ids.bindings()) == ["live-1", "new", "other"], "its own oldest idle id went"


def test_a_full_table_forgets_the_idle_ids_of_the_key_holding_the_most_first(monkeypatch):
    monkeypatch.setattr(actor_ids, "MAX_BOUND_IDS", 4)
    ids = actor_ids.ActorIds()
    assert ids.claim(["small-1"], "small", lambda name: False) is None
    for name in ("big-1", "big-2", "big-3"):
        assert ids.claim([name], "big", lambda name: False) is None
    assert ids.claim(["newcomer"], "new", lambda name: False) is None
    assert sorted(ids.bindings()) == ["big-2", "big-3", "newcomer", "small-1"], "small-1 is older, big-1 goes"


def test_one_key_may_open_only_max_sessions_per_key_sessions():
    """Issue 39 item 2: one key could open max_actors (1,024) sessions, summing their lease caps and locking every
    other key out with too_many_actors."""
    registry = Registry(ServerConfig(max_actors=10, max_sessions_per_key=3), learner_metrics())
    for serial in range(3):
        assert registry.hello(f"s-{serial}".encode(), "greedy", _hello(f"s-{serial}"), "") is None
    refusal = registry.hello(b"s-3", "greedy", _hello("s-3"), "")
    assert refusal is not None and refusal.reason == "too_many_sessions" and "max_sessions_per_key" in refusal.detail
    assert _sample(registry, "grpo_fleet_learner_protocol_errors_total", {"reason": "too_many_sessions"}) == 1
    assert registry.hello(b"s-0", "greedy", _hello("s-0"), "") is None, "a live session may say Hello again"
    assert registry.hello(b"other", "other-key", _hello("other"), "") is None
    assert registry.sessions("greedy") == 3 and registry.key_count() == 2


def test_a_welcomed_actor_may_load_its_model_in_silence_until_its_first_request(registry):
    # Two actors of the long-answer demo were dropped 20 s after their Welcome while they imported SmolLM2, and the
    # learner then evaluated a whole eval round itself (226 s at 256-token answers).
    registry.hello(b"id-a", "key-a", _hello(), "")
    actor = registry.actors[b"id-a"]
    quiet = actor.last_seen + 60.0  # past 10 heartbeats of 2 s, within a 300 s load
    assert not is_silent(actor, quiet, silence=20.0, load_grace=300.0), "loading: not silent yet"
    assert is_silent(actor, actor.last_seen + 301.0, silence=20.0, load_grace=300.0), "the grace has an end"
    registry.known(b"id-a", "key-a")  # its first request (GetWeights): loaded
    assert is_silent(actor, actor.last_seen + 21.0, silence=20.0, load_grace=300.0)
    assert not is_silent(actor, actor.last_seen + 19.0, silence=20.0, load_grace=300.0)
