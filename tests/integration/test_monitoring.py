"""Monitoring with real tools: promtool on live /metrics, a real Prometheus using the learner's HTTP SD, and `status`."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from grpo_fleet.actor.worker import ActorWorker, serve_actor_metrics
from grpo_fleet.config import ActorConfig, MetricsConfig
from grpo_fleet.learner.door.server import LearnerServer
from grpo_fleet.learner.run.build import build_learner
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.observe.metrics_http import serve_metrics
from grpo_fleet.runtime.blas import child_env
from helpers import wait_for

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _start_fleet(run_config, spawn, free_port, actors: int):
    path, cfg = run_config(
        train={"steps": 100000, "checkpoint_every": 100000},
        server={"heartbeat_seconds": 0.5},
        metrics={"port": free_port()},
    )
    learner = spawn("learner", "--config", str(path), name="learner")
    ports = [free_port() for _ in range(actors)]
    fleet = [
        spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"mon-{i}", "--metrics-port", str(port),
              "--model-dir", cfg.run_dir, name=f"actor{i}")
        for i, port in enumerate(ports)
    ]
    return cfg, learner, fleet, ports


def _sd(cfg) -> list[dict]:
    return json.loads(_get(f"http://127.0.0.1:{cfg.metrics.port}/sd"))


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus'; `make test` installs it)")
def test_live_metrics_pass_promtool_and_status_lists_actors(run_config, spawn, free_port):
    cfg, learner, fleet, ports = _start_fleet(run_config, spawn, free_port, actors=2)
    wait_for(lambda: len(_sd(cfg)) == 3, "learner + 2 actors in service discovery", procs=(learner, *fleet))
    wait_for(lambda: b"grpo_fleet_learner_steps_total 0.0" not in _get(f"http://127.0.0.1:{cfg.metrics.port}/metrics"),
              "a training step", procs=(learner,))
    for port in (cfg.metrics.port, *ports):
        page = _get(f"http://127.0.0.1:{port}/metrics")
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, timeout=30)
        assert check.returncode == 0 and check.stdout.strip() == b"" and check.stderr.strip() == b"", (
            f"promtool on :{port}: {check.stdout.decode()} {check.stderr.decode()}"
        )

    status = subprocess.run([sys.executable, "-m", "grpo_fleet", "status", "--connect", cfg.server.bind],
                            capture_output=True, text=True, env=child_env(), timeout=60)
    assert status.returncode == 0, status.stderr
    assert "mon-0" in status.stdout and "mon-1" in status.stdout and "step" in status.stdout


def _prometheus_config(tmp_path: Path, sd_url: str) -> Path:
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: grpo-fleet
    http_sd_configs:
      - url: {sd_url}
        refresh_interval: 1s
""")
    return config


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
    return json.loads(_get(url))["data"]["result"]


def _active_actor_targets(port: int) -> set[str]:
    targets = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/targets"))["data"]["activeTargets"]
    return {t["labels"].get("actor") for t in targets if t["labels"].get("role") == "actor"}


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package 'prometheus'; `make test` installs it)")
def test_real_prometheus_discovers_and_scrapes_the_fleet(run_config, spawn, free_port, tmp_path):
    cfg, learner, fleet, _ = _start_fleet(run_config, spawn, free_port, actors=2)
    prom_port = free_port()
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={_prometheus_config(tmp_path, f'http://127.0.0.1:{cfg.metrics.port}/sd')}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"),
    )
    try:
        up = lambda: [r for r in _query(prom_port, "up") if r["value"][1] == "1"]  # noqa: E731
        wait_for(lambda: len(up()) == 3, "up == 1 for the learner and both actors", procs=(learner, *fleet, prometheus))
        wait_for(lambda: _query(prom_port, "grpo_fleet_learner_steps_total > 0"), "steps series > 0")
        wait_for(lambda: _query(prom_port, "sum(grpo_fleet_actor_tokens_generated_total) > 0"), "tokens series > 0")
        # Prometheus rebuilds its target pools on each service-discovery refresh: read the set as it settles
        # (fc10 read it empty once, between "up" for all three and this line).
        wait_for(lambda: _active_actor_targets(prom_port) == {"mon-0", "mon-1"}, "both actors as active targets",
                 procs=(learner, *fleet, prometheus))

        fleet[1].send_signal(signal.SIGTERM)
        assert fleet[1].wait(timeout=30) == 0
        wait_for(lambda: _active_actor_targets(prom_port) == {"mon-0"}, "the stopped actor to leave the targets")
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


def test_actor_metrics_fall_back_to_a_free_port_when_taken():
    import socket
    import urllib.request

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    worker = ActorWorker(ActorConfig(metrics=MetricsConfig(host="127.0.0.1", port=port)))
    served = None
    try:
        served = serve_actor_metrics(worker.metrics, worker.cfg.metrics)
        assert served is not None and served.port != port
        with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=5) as response:
            assert b"grpo_fleet_actor_tokens_generated_total" in response.read()
    finally:
        taken.close()
        worker.link.shut()
        if served is not None:
            served.close()


def _metrics_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "metrics-http"]


def _port_is_free(port: int) -> bool:
    probe = socket.socket()
    # SO_REUSEADDR, as servers bind: the closed scrape's TIME_WAIT does not count, a listener still there does.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))
        probe.listen()
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_a_closed_metrics_server_leaves_no_thread_and_no_port_behind():
    before = _metrics_threads()
    served = serve_metrics(learner_metrics().registry, "127.0.0.1", 0, any_port=True)
    assert served is not None
    assert b"grpo_fleet_learner_steps_total" in _get(f"http://127.0.0.1:{served.port}/metrics")
    assert len(_metrics_threads()) == len(before) + 1
    served.close()
    served.close()  # twice is harmless
    assert _metrics_threads() == before
    with pytest.raises(OSError):  # connection refused
        _get(f"http://127.0.0.1:{served.port}/metrics")
    assert _port_is_free(served.port)


def test_a_stopped_learner_closes_its_metrics_server(run_config, free_port):
    _, cfg = run_config(metrics={"port": free_port()})
    server = LearnerServer(build_learner(cfg))
    server.start_metrics()
    assert b"grpo_fleet_learner" in _get(f"http://127.0.0.1:{cfg.metrics.port}/metrics")
    server.close()
    assert _port_is_free(cfg.metrics.port)
    assert all(thread.name != "metrics-http" for thread in threading.enumerate())


def test_a_stopped_actor_closes_its_metrics_server(free_port):
    port = free_port()
    worker = ActorWorker(ActorConfig(metrics=MetricsConfig(host="127.0.0.1", port=port)))
    worker.stopping = True  # asked to stop before it ever reached the learner
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        worker.run()
    finally:  # run() installs its own; give pytest's back
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    assert worker.metrics_port == port
    assert _port_is_free(port)
