"""Keys on disk, the reloadable allow-list, and an actor's key files (what it refuses: test_admission)."""

from __future__ import annotations

import ast
import stat
from pathlib import Path

import pytest

from grpo_fleet.actor.admission import ActorRefused
from grpo_fleet.actor.worker import ActorWorker
from grpo_fleet.config import ActorConfig, MetricsConfig
from grpo_fleet.protocol.auth import KeyRing, add_actor, add_observer, init_keys, load_keypair, revoke_actor

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "grpo_fleet"


def test_keys_init_and_add_actor_write_private_secrets(tmp_path):
    keys = tmp_path / "keys"
    public = init_keys(keys)
    secret = add_actor(keys, "mac-mini-1")
    for path in (keys / "learner.key_secret", secret):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public.read_text().count("secret-key") == 0
    assert (keys / "authorized" / "mac-mini-1.key").exists()
    assert load_keypair(secret).secret is not None and load_keypair(public).secret is None
    with pytest.raises(FileExistsError):
        add_actor(keys, "mac-mini-1")
    with pytest.raises(ValueError):
        add_actor(keys, "../escape")


def test_add_actor_needs_learner_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match="keys init"):
        add_actor(tmp_path, "a")


def test_keyring_reloads_when_the_allow_list_changes(tmp_path):
    keys = tmp_path / "keys"
    init_keys(keys)
    secret = add_actor(keys, "a")
    key_a = load_keypair(secret).public
    ring = KeyRing(keys / "authorized")
    assert ring.allows(key_a) and ring.callback("*", key_a)
    assert not ring.reload_if_changed()
    add_actor(keys, "b")
    assert ring.reload_if_changed()
    assert revoke_actor(keys, "a")
    assert ring.reload_if_changed()
    assert not ring.allows(key_a)
    assert not revoke_actor(keys, "a")


def test_an_observer_key_passes_the_handshake_as_an_observer_only(tmp_path):
    keys = tmp_path / "keys"
    init_keys(keys)
    actor = load_keypair(add_actor(keys, "mac1")).public
    secret = add_observer(keys, "grafana")
    assert secret == keys / "observers" / "grafana.key_secret"
    assert secret.stat().st_mode & 0o077 == 0
    observer = load_keypair(secret).public
    ring = KeyRing(keys / "authorized")
    assert ring.allows(observer) and ring.is_observer(observer)  # CURVE lets it in; the learner answers Status only
    assert ring.allows(actor) and not ring.is_observer(actor)
    assert revoke_actor(keys, "grafana")
    assert ring.reload_if_changed()
    assert not ring.allows(observer) and not ring.is_observer(observer)


def test_actor_needs_both_curve_key_files(tmp_path):
    with pytest.raises(ActorRefused, match="both"):
        ActorWorker(ActorConfig(key_file=str(tmp_path / "a.key_secret"), metrics=MetricsConfig(port=0)))


FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_package_never_unpickles_or_evaluates_received_data():
    offences = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                offences += [f"{path.name}: import {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                offences.append(f"{path.name}:{node.lineno}: {node.func.id}()")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("loads", "load"):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in FORBIDDEN_MODULES:
                    offences.append(f"{path.name}:{node.lineno}: {owner.id}.{node.func.attr}()")
    assert offences == []
    assert len(list(PACKAGE.rglob("*.py"))) > 20, "the scan must actually see the package"




def test_with_curve_an_actors_routing_id_carries_a_tag_only_its_secret_key_makes(tmp_path):
    """Issue 29: the ROUTER hands a routing id to whoever connects with it last; actor ids are public, so any
    allowed key could take an actor's connection over. With CURVE the routing id is tagged with the actor's key."""
    from grpo_fleet.actor.link import routing_id
    from grpo_fleet.protocol.auth import add_actor, init_keys, load_keypair

    learner_public = init_keys(tmp_path)
    curve = (load_keypair(add_actor(tmp_path, "mac1")), load_keypair(learner_public).public)
    other = (load_keypair(add_actor(tmp_path, "mac2")), curve[1])
    mine = routing_id("studio-1", curve)
    assert mine.startswith(b"studio-1.") and mine != b"studio-1"
    assert routing_id("studio-1", curve) == mine, "the same after a restart with the same key"
    assert routing_id("studio-1", other) != mine, "another key cannot make it"
    assert routing_id("studio-1", None) == b"studio-1"  # without CURVE there is no secret to tag it with
