"""Shared fixtures: free ports, the tiny model built once per session, and process spawning."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from grpo_fleet.blas import child_env
from grpo_fleet.config import TaskConfig, TinyModelConfig
from grpo_fleet.learner.setup import tokenizer_corpus
from grpo_fleet.model import build_tiny_model
from grpo_fleet.tasks import build_task


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function giving a TCP port on 127.0.0.1 that is free right now."""

    def pick() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    return pick


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The self-built tiny model for the reverse task, as an HF-format directory."""
    task = build_task(TaskConfig(name="reverse", digits=3, num_train=200, num_eval=32))
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-reverse", TinyModelConfig(seed=0), tokenizer_corpus(task))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer covers the bundled GSM8K-style data and the R1 tags."""
    task = build_task(TaskConfig(
        name="jsonl", train_path="builtin:gsm8k_mini", eval_path="builtin:gsm8k_mini_eval",
        rewards=["r1_format", "r1_accuracy"], chat_template=True,
    ))
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", TinyModelConfig(seed=1), tokenizer_corpus(task))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `python -m grpo_fleet ARGS` processes; kills only those it started."""
    started: list[subprocess.Popen] = []

    def start(*args: str, name: str = "proc") -> subprocess.Popen:
        log = open(tmp_path / f"{name}-{len(started)}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_fleet", *args], stdout=log, stderr=subprocess.STDOUT,
            env=child_env(), start_new_session=True,
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in started:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
