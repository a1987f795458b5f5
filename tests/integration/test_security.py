"""CURVE in real processes: authorised actors train, others never reach the application."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo_fleet.config import RunConfig
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.auth import add_actor, add_observer, client_curve, init_keys, load_keypair, revoke_actor
from grpo_fleet.protocol.client import Client, request_status
from grpo_fleet.runtime.blas import child_env
from helpers import jsonl, scrape


def _metric(port: int, name: str) -> float:
    try:
        return scrape(port, timeout=2).total(name)
    except OSError:
        return -1.0


def _config(run_config, free_port, keys: Path, steps: int) -> tuple[Path, RunConfig]:
    # Short leases so a revoked actor's work goes to others quickly; checkpoints only at the
    # end or on SIGTERM; /metrics on a real port because the tests read the auth-failure count.
    return run_config(
        train={"steps": steps, "checkpoint_every": 1000},
        server={"lease_seconds": 3.0, "heartbeat_seconds": 0.5},
        security={"keys_dir": str(keys)},
        metrics={"port": free_port()},
    )


def _actor(spawn, cfg: RunConfig, keys: Path, name: str, secret: Path):
    return spawn("actor", "--connect", cfg.server.bind, "--actor-id", name, "--key", str(secret),
                 "--learner-key", str(keys / "learner.key"), "--metrics-port", "0", "--request-timeout", "3",
                 "--model-dir", cfg.run_dir, name=name)


def test_only_the_authorised_key_gets_in(tmp_path, run_config, free_port, spawn):
    keys = tmp_path / "keys"
    init_keys(keys)
    good = add_actor(keys, "good")
    stranger_dir = tmp_path / "stranger"
    init_keys(stranger_dir)  # a valid keypair the learner has never heard of
    config, cfg = _config(run_config, free_port, keys, steps=30)
    learner = spawn("learner", "--config", str(config), name="learner")
    intruder = _actor(spawn, cfg, keys, "intruder", stranger_dir / "learner.key_secret")
    keyless = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "keyless", "--metrics-port", "0",
                    "--request-timeout", "3", "--model-dir", cfg.run_dir, name="keyless")
    failures = 0.0
    deadline = time.monotonic() + 120
    while failures <= 0 and time.monotonic() < deadline:
        failures = _metric(cfg.metrics.port, "grpo_fleet_learner_auth_failures_total")
        time.sleep(0.3)
    assert failures > 0, "refused handshakes are counted"
    honest = _actor(spawn, cfg, keys, "good", good)
    assert learner.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
    assert honest.wait(timeout=30) == 0

    ledger = jsonl(Path(cfg.run_dir) / "ledger.jsonl")
    good_key = load_keypair(good).public.decode()
    assert ledger and {entry["actor_key"] for entry in ledger} == {good_key}
    assert intruder.poll() is None and keyless.poll() is None, "outsiders never got a Welcome, let alone a Shutdown"
    assert "refused CURVE handshake" in learner.log_path.read_text()


def test_revoked_actor_is_cut_off_and_its_leases_go_to_others(tmp_path, run_config, free_port, spawn):
    keys = tmp_path / "keys"
    init_keys(keys)
    secrets = {name: add_actor(keys, name) for name in ("stays", "goes")}
    config, cfg = _config(run_config, free_port, keys, steps=100000)
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    for name, secret in secrets.items():
        _actor(spawn, cfg, keys, name, secret)  # the spawn fixture stops them at the end
    goes_key = load_keypair(secrets["goes"]).public.decode()
    deadline = time.monotonic() + 120
    while not any(e["actor_key"] == goes_key for e in jsonl(run_dir / "ledger.jsonl")):
        assert time.monotonic() < deadline and learner.poll() is None
        time.sleep(0.2)

    revoke_actor(keys, "goes")
    learner.send_signal(signal.SIGHUP)
    while _metric(cfg.metrics.port, "grpo_fleet_learner_auth_failures_total") <= 0:
        assert time.monotonic() < deadline and learner.poll() is None
        time.sleep(0.2)
    cutoff = len(jsonl(run_dir / "ledger.jsonl"))
    target = len(jsonl(run_dir / "metrics.jsonl")) + 15
    while len(jsonl(run_dir / "metrics.jsonl")) < target:
        assert time.monotonic() < deadline + 60 and learner.poll() is None
        time.sleep(0.2)
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=30) == 0

    after = jsonl(run_dir / "ledger.jsonl")[cutoff:]
    assert after, "training went on with the remaining actor"
    assert {e["actor_key"] for e in after if "event" not in e} == {load_keypair(secrets["stays"]).public.decode()}
    from grpo_fleet.learner.records.persistence import read_state
    from grpo_fleet.models.loading import latest_checkpoint

    open_leases = read_state(latest_checkpoint(run_dir))["scheduler"]["leases"]
    assert all(lease["actor"] != goes_key for lease in open_leases)


def test_learner_refuses_a_network_bind_without_keys(tmp_path, free_port):
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_fleet", "learner", "--run-dir", str(tmp_path / "run"),
         "--bind", f"tcp://0.0.0.0:{free_port()}"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )
    assert proc.returncode == 2
    assert "without CURVE" in proc.stderr and "keys init" in proc.stderr
    assert not (tmp_path / "run").exists(), "nothing was started or written"


def test_actor_refuses_a_model_outside_its_allowed_dirs(tmp_path, free_port, spawn):
    run_dir, bind = tmp_path / "run", f"tcp://127.0.0.1:{free_port()}"
    learner = spawn("learner", "--run-dir", str(run_dir), "--bind", bind, "--metrics-port", "0",
                    "--set", f'server.pub_bind="tcp://127.0.0.1:{free_port()}"', name="learner")
    actor = spawn("actor", "--connect", bind, "--metrics-port", "0", "--model-dir", str(tmp_path / "elsewhere"), name="actor")
    assert actor.wait(timeout=120) == 2
    assert "outside the allowed directories" in actor.log_path.read_text()
    assert learner.poll() is None


def test_an_observer_key_reads_status_but_cannot_join(tmp_path, run_config, free_port, spawn):
    keys = tmp_path / "keys"
    init_keys(keys)
    observer = add_observer(keys, "grafana")
    config, cfg = _config(run_config, free_port, keys, steps=100000)
    learner = spawn("learner", "--config", str(config), name="learner")
    deadline = time.monotonic() + 180
    while _metric(cfg.metrics.port, "grpo_fleet_learner_auth_failures_total") < 0:  # up once /metrics answers
        assert time.monotonic() < deadline and learner.poll() is None, learner.log_path.read_text()[-3000:]
        time.sleep(0.3)
    curve = client_curve(observer, keys / "learner.key")
    status = request_status(cfg.server.bind, key_file=str(observer), learner_key_file=str(keys / "learner.key"),
                            timeout_s=30)
    assert status.step == 0
    with Client(cfg.server.bind, identity="peeker", curve=curve) as client:
        reply = client.request(m.Hello(actor_id="peeker", host="h", backend="cpu", versions={}), 30)
    assert isinstance(reply, m.ErrorReply) and reply.reason == "forbidden", reply
    assert scrape(cfg.metrics.port).by_label("reason")[("grpo_fleet_learner_auth_failures_total", "observer")] == 1
    assert learner.poll() is None
