"""A local Hugging Face dataset end to end: chat-format prompts, math-verify rewards, a cosine schedule, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from datasets import Dataset, DatasetDict

from grpo_fleet.config import OptimConfig
from grpo_fleet.learner.schedule import learning_rate_schedule
from grpo_fleet.model import latest_checkpoint
from grpo_fleet.tasks import data_path


def gsm8k_as_chat(path: Path) -> Dataset:
    """The bundled GSM8K-style rows as a chat dataset: messages, the raw worked solution, and one more column."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Dataset.from_dict({
        "messages": [[{"role": "system", "content": "Answer in <answer></answer>."},
                      {"role": "user", "content": row["question"]}] for row in rows],
        "solution": [row["answer"] for row in rows],
        "difficulty": [len(row["question"]) for row in rows],
    })


def test_saved_dataset_with_chat_prompts_trains_on_the_schedule(run_config, spawn, tmp_path):
    dataset_dir = tmp_path / "gsm8k-chat"
    DatasetDict({
        "train": gsm8k_as_chat(data_path("gsm8k_mini.jsonl")),
        "test": gsm8k_as_chat(data_path("gsm8k_mini_eval.jsonl")),
    }).save_to_disk(str(dataset_dir))
    optim = {"lr": 1e-3, "schedule": "cosine", "warmup_steps": 2, "min_lr": 1e-4}
    config, cfg = run_config(
        lora={"enabled": True, "rank": 4},
        generation={"max_tokens": 16},
        task={
            "name": "dataset", "dataset": str(dataset_dir), "eval_split": "test",
            "prompt_column": "messages", "answer_column": "solution",
            "rewards": ["r1_format", "r1_accuracy", "reverse_positions"], "reward_weights": [0.5, 1.0, 0.1],
        },
        optim=optim,
        train={"steps": 4, "checkpoint_every": 2},
    )
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--metrics-port", "0", "--model-dir", str(run_dir), name="actor")
    assert learner.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=30) == 0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # The optimizer state of the last checkpoint holds the schedule's place: 4 updates, at the rate of the 4th.
    state = mx.load(str(latest_checkpoint(run_dir) / "optimizer.safetensors"))
    assert int(state["step"]) == 4
    # decay_steps defaults to the 4 steps minus 2 of warm-up.
    schedule = learning_rate_schedule(OptimConfig(**optim, decay_steps=2))
    assert float(state["learning_rate"]) == pytest.approx(float(schedule(mx.array(3, mx.uint64))), rel=1e-6)
