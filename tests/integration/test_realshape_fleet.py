"""A real-shape 4-bit model through real processes: the learner resolves `realshape:`, an actor with
no --model-dir rebuilds (here: finds) it in its own cache, both dequantise on the CPU, and the run
trains two steps at the full 151,936-token vocabulary over TCP; its adapter loads with mlx_lm."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from grpo_fleet.models.loading import latest_checkpoint, model_digest
from grpo_fleet.protocol.client import request_status
from helpers import assert_checkpoint_generates_like_the_learner


@pytest.mark.slow
def test_actor_joins_a_realshape_4bit_run_and_delivers(run_config, spawn, monkeypatch, realshape_cache_dir,
                                                       realshape_q4_model_dir):
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(realshape_cache_dir))  # both processes' default cache
    config, cfg = run_config(
        model={"path": "realshape:qwen2.5-0.5b?layers=1&bits=4"},
        lora={"enabled": True, "rank": 4},
        # A random model over 151,936 tokens never writes digits; this reward is graded from its first sample.
        task={"name": "reverse", "num_train": 50, "num_eval": 4, "chat_template": True,
              "rewards": ["language_consistency"]},
        generation={"group_size": 4, "max_tokens": 4},
        grpo={"groups_per_step": 1},
        train={"steps": 2, "checkpoint_every": 1000},
        # Calibrating the half-precision bound samples in bf16, some 20 s of CPU at this vocabulary, for actors
        # that never come here (the fp32 one is not calibrated); test_demo_real calibrates on a real model.
        security={"calibration_prompts": 0},
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

    learner.wait(timeout=300)
    assert learner.returncode == 0, learner.log_path.read_text()[-3000:]
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["skipped"] is None and math.isfinite(record["loss"])
        assert record["peak_memory_bytes"] > 151936 * 896 * 4, "the fp32 embedding alone is this big"
    checkpoint = latest_checkpoint(Path(cfg.run_dir))
    base = json.loads((checkpoint / "grpo_fleet.json").read_text())["base_model"]
    assert base == json.loads((checkpoint / "adapter_config.json").read_text())["model"]
    assert_checkpoint_generates_like_the_learner(checkpoint, "12=", max_tokens=3)


def test_actor_rebuilds_the_learners_realshape_model_in_its_own_cache(realshape_cache_dir, realshape_model_dir,
                                                                      monkeypatch, tmp_path):
    """Admission starts the actor's reward process, so this lives here rather than in tests/unit."""
    from grpo_fleet.actor.worker import ActorRefused, ActorWorker
    from grpo_fleet.config import ActorConfig, MetricsConfig
    from grpo_fleet.protocol import messages as m

    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(realshape_cache_dir))
    learner_path = f"/Users/learner/.cache/grpo-fleet/models/{realshape_model_dir.name}"  # not on this machine

    def welcome(digest: str) -> m.Welcome:
        return m.Welcome(
            run_id="r", actor_id="a", model=m.ModelRef(path=learner_path, digest=digest),
            generation=m.GenerationParams(group_size=2, max_tokens=2, temperature=1.0, top_p=1.0),
            reward=m.RewardSpec(names=["exact_match"], weights=[1.0]),
            policy_version=0, heartbeat_seconds=1.0, vocab_size=151_936,
        )

    worker = ActorWorker(ActorConfig(model_dirs=[str(tmp_path)], metrics=MetricsConfig(port=0)))
    try:
        with pytest.raises(ActorRefused, match="digest mismatch"):
            worker._adopt(welcome("0" * 64))
        worker._adopt(welcome(model_digest(str(realshape_model_dir))))
        assert worker.policy is not None and worker.policy.path == str(realshape_model_dir)
    finally:
        worker.link.shut()
