"""A real-shape 4-bit model through real processes: the learner resolves `realshape:`, an actor with
no --model-dir rebuilds (here: finds) it in its own cache, both dequantise on the CPU, rollouts flow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_fleet.protocol.client import request_status


@pytest.mark.slow
def test_actor_joins_a_realshape_4bit_run_and_delivers(run_config, spawn, monkeypatch, realshape_cache_dir,
                                                       realshape_q4_model_dir):
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(realshape_cache_dir))  # both processes' default cache
    config, cfg = run_config(
        model={"path": "realshape:qwen2.5-0.5b?layers=1&bits=4"},
        lora={"enabled": True, "rank": 4},
        task={"name": "reverse", "num_train": 50, "num_eval": 4, "chat_template": True},
        generation={"group_size": 2, "max_tokens": 4},
    )
    learner = spawn("learner", "--config", str(config), name="learner")
    # No --model-dir: the learner's path is inside a cache the actor was never told about.
    actor = spawn("actor", "--connect", cfg.server.bind, "--metrics-port", "0", name="actor")
    deadline = time.monotonic() + 180
    accepted = 0
    while time.monotonic() < deadline and accepted == 0:
        assert learner.poll() is None, learner.log_path.read_text()[-3000:]
        assert actor.poll() is None, actor.log_path.read_text()[-3000:]
        try:
            accepted = request_status(cfg.server.bind, timeout_s=2).groups_accepted
        except TimeoutError:
            pass
        time.sleep(1)
    assert accepted > 0, actor.log_path.read_text()[-3000:]
    actor_log = Path(actor.log_path).read_text()
    assert "dequantised to float32" in actor_log and "outside the allowed" not in actor_log
    assert "dequantised to float32" in Path(learner.log_path).read_text()
    assert not list(realshape_cache_dir.glob(".*"))  # nothing was built half-way
