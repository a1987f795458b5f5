"""Benchmark 3: how long a policy version takes to reach 1, 8 and 32 actors.

The learner is a real `grpo-fleet learner` process serving its snapshot; each
actor is a separate process running the actor's own `fetch_weights` (chunked,
credit window, BLAKE3 check). The baseline is a raw ZeroMQ transfer of the same
bytes, one zero-copy frame per receiver, measured in the same run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.models import model_50m
from grpo_fleet.protocol.endpoints import loopback_endpoint
from grpo_fleet.runtime.blas import child_env

CTX = mp.get_context("spawn")
# The learner's message cap and the raw baseline's, above the 50M model's full weights in fp32.
MAX_WEIGHTS_BYTES = 1 << 30
RAW_REQUEST_BYTES = 1 << 10  # the baseline's requests are the three bytes b"get"
TRANSFER_TIMEOUT_S = 600


def _start_learner(model_dir: Path, root: Path, lora: bool) -> tuple[subprocess.Popen, str]:
    bind = loopback_endpoint()
    config = {
        "run_dir": str(root / ("run-lora" if lora else "run-full")),
        "model": {"path": str(model_dir)},
        "lora": {"enabled": lora, "rank": 8},
        "grpo": {"beta": 0.0},
        "task": {"num_train": 100, "num_eval": 8},
        "server": {"bind": bind, "pub_bind": loopback_endpoint(), "max_message_bytes": MAX_WEIGHTS_BYTES},
        "metrics": {"port": 0},
    }
    path = root / ("lora.json" if lora else "full.json")
    path.write_text(json.dumps(config))
    log = open(root / f"{path.stem}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_fleet", "learner", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env())
    return proc, bind


def _fleet_actor(endpoint: str, index: int, go: Any, results: Any) -> None:
    """One actor process: register, wait for the start signal, fetch and verify the snapshot."""
    from grpo_fleet.actor.weights_sync import fetch_weights
    from grpo_fleet.actor.worker import ActorWorker
    from grpo_fleet.config import ActorConfig, MetricsConfig

    worker = ActorWorker(ActorConfig(connect=endpoint, actor_id=f"bench-{index}", request_timeout=300,
                                     metrics=MetricsConfig(port=0)))
    worker.connect()
    results.put(("ready", index, 0.0, 0))
    go.wait()
    _, blob, _ = fetch_weights(worker.link, 0)
    results.put(("done", index, time.time(), len(blob)))


def _raw_server(endpoint_queue: Any, size: int, stop: Any) -> None:
    """Baseline: a ROUTER that answers each request with the same bytes, zero-copy, nothing decoded."""
    from grpo_fleet.protocol.sockets import bound_endpoint, make_context, recv_frames, router_socket, send_frames

    ctx = make_context()
    router = router_socket(ctx, "tcp://127.0.0.1:0", max_message_bytes=RAW_REQUEST_BYTES)
    blob = bytes(size)
    endpoint_queue.put(bound_endpoint(router))
    while not stop.is_set():
        frames = recv_frames(router, timeout_s=0.1)
        if frames is not None:
            send_frames(router, [frames[0], blob])
    router.close(linger=0)
    ctx.term()


def _raw_actor(endpoint: str, index: int, go: Any, results: Any) -> None:
    from grpo_fleet.protocol.sockets import dealer_socket, make_context, recv_frames, send_frames

    ctx = make_context()
    dealer = dealer_socket(ctx, endpoint, identity=None, max_message_bytes=MAX_WEIGHTS_BYTES)
    results.put(("ready", index, 0.0, 0))
    go.wait()
    send_frames(dealer, [b"get"])
    frames = recv_frames(dealer, timeout_s=TRANSFER_TIMEOUT_S)
    results.put(("done", index, time.time(), len(frames[0]) if frames else 0))
    dealer.close(linger=0)
    ctx.term()


def _distribute(target: Callable[..., None], endpoint: str, actors: int) -> tuple[float, int]:
    """Start `actors` receivers, release them together, return (seconds until the last has it, bytes each)."""
    go, results = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=target, args=(endpoint, i, go, results)) for i in range(actors)]
    for proc in procs:
        proc.start()
    try:
        for _ in range(actors):
            results.get(timeout=300)
        started = time.time()
        go.set()
        finished = [results.get(timeout=TRANSFER_TIMEOUT_S) for _ in range(actors)]
        return max(t for _, _, t, _ in finished) - started, finished[0][3]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _raw_seconds(size: int, actors: int) -> float:
    endpoints, stop = CTX.Queue(), CTX.Event()
    server = CTX.Process(target=_raw_server, args=(endpoints, size, stop))
    server.start()
    try:
        seconds, _ = _distribute(_raw_actor, endpoints.get(timeout=60), actors)
        return seconds
    finally:
        stop.set()
        server.join(timeout=10)


def _measure(report: Report, model_dir: Path, root: Path, lora: bool, counts: list[int]) -> None:
    learner, endpoint = _start_learner(model_dir, root, lora)
    payload = "LoRA adapters" if lora else "full weights (50M)"
    try:
        for actors in counts:
            seconds, size = _distribute(_fleet_actor, endpoint, actors)
            raw = _raw_seconds(size, actors)
            mb = size * actors / 1e6
            if lora:
                report.add(Figure("weights", f"{payload}, {size / 1e3:.0f} kB to {actors} actors", seconds * 1e3, "ms",
                                  baseline=raw * 1e3, baseline_name="raw ZeroMQ ms", goal="<= 50 ms at 8 actors"))
            else:
                report.add(Figure("weights", f"{payload}, {size / 1e6:.0f} MB to {actors} actors", mb / seconds, "MB/s",
                                  baseline=mb / raw, baseline_name="raw ZeroMQ MB/s", goal=">= 0.3x of raw"))
    finally:
        learner.terminate()
        learner.wait(timeout=30)


def run(report: Report, scale: Scale) -> None:
    # 32 receiving processes take most of this benchmark's time on 2 cores: the full run only.
    counts = [1, 8, 32] if scale is Scale.FULL else [1, 8]
    with tempfile.TemporaryDirectory(prefix="grpo-bench-weights-") as tmp:
        root = Path(tmp)
        model_dir = model_50m(root)
        _measure(report, model_dir, root, lora=True, counts=counts)
        _measure(report, model_dir, root, lora=False, counts=counts)
