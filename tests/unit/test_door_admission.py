"""Who the door lets in under CURVE: observer keys ask Status only, and a key revoked from the allow-list is cut
off. Driven through the door's transport held in memory (tests/memory_transport.py) on a real tiny learner; the
keys are real CURVE keys on disk, the principal is what ZeroMQ's ZAP would name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from grpo_fleet.learner.door.dispatch import door_of
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.protocol import encode
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import KeyRing, add_actor, add_observer, init_keys, load_keypair, revoke_actor
from memory_transport import MemoryTransport

HELLO = m.Hello(actor_id="mac1", host="testhost", backend="cpu", versions={})


def _auth_failures(learner: RunCoordinator, reason: str) -> float:
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_auth_failures_total", {"reason": reason}) or 0


def _keys(directory: Path) -> tuple[KeyRing, str, str]:
    """An allow-list with one actor and one observer key, and the two principals."""
    init_keys(directory)
    actor = load_keypair(add_actor(directory, "mac1")).public.decode()
    observer = load_keypair(add_observer(directory, "watcher")).public.decode()
    return KeyRing(directory / "authorized"), actor, observer


def test_an_observer_key_is_answered_status_and_refused_anything_else(make: Callable[..., RunCoordinator],
                                                                       tmp_path: Path) -> None:
    learner = make()
    keyring, _, observer = _keys(tmp_path / "keys")
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring, verifier=None)
    transport.deliver(b"watcher", encode(m.StatusRequest()), principal=observer)
    transport.deliver(b"watcher", encode(HELLO), principal=observer)
    door.pump(timeout_ms=0)
    status, refused = transport.replies_to(b"watcher")
    assert isinstance(status, m.Status)
    assert isinstance(refused, m.ErrorReply) and refused.reason == "forbidden"
    assert learner.registry.actors == {} and _auth_failures(learner, "observer") == 1


def test_a_key_revoked_from_the_allow_list_is_cut_off_and_its_next_message_dropped(
        make: Callable[..., RunCoordinator], tmp_path: Path) -> None:
    learner = make()
    keyring, actor, _ = _keys(tmp_path / "keys")
    transport = MemoryTransport()
    door = door_of(learner, transport, keyring, verifier=None)
    transport.deliver(b"mac1", encode(HELLO), principal=actor)
    door.pump(timeout_ms=0)
    assert b"mac1" in learner.registry.actors
    assert revoke_actor(tmp_path / "keys", "mac1")
    door.admission.request_reload()  # as SIGHUP does
    door.admission.reload_allow_list()
    assert b"mac1" not in learner.registry.actors
    transport.deliver(b"mac1", encode(m.Heartbeat(actor_id="mac1")), principal=actor)
    door.pump(timeout_ms=0)
    assert len(transport.sent) == 1  # the Welcome only: nothing answers a revoked key
    assert _auth_failures(learner, "revoked") == 1
