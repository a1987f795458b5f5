"""Tests for grpo_fleet.learner.fleet.registry: who is connected, under which key, how fast, and who is banned."""

from __future__ import annotations

import pytest

from grpo_fleet.config import ServerConfig
from grpo_fleet.learner.fleet.registry import Registry, RunCard, is_silent
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.persistence import capture, restore, state_from_dict, state_to_dict
from grpo_fleet.learner.records.runlog import LogSizes
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.metrics import learner_metrics
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
    import grpo_fleet.learner.records.actor_ids as actor_ids

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
