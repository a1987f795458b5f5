"""The GSM8K-style path end to end (JSONL, or a local Hugging Face dataset), chat prompts, R1 rewards, LoRA, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from datasets import Dataset, DatasetDict

from grpo_fleet.config import OptimConfig, RunConfig
from grpo_fleet.learner.step.schedule import learning_rate_schedule
from grpo_fleet.models.loading import latest_checkpoint
from grpo_fleet.tasks import data_path
from helpers import assert_checkpoint_generates_like_the_learner
from recipe_helpers import BREVITY_REWARD


def train_with_one_actor(spawn, config: Path, cfg: RunConfig) -> list[dict]:
    """Run the learner and one actor to the end of training; the learner's metrics.jsonl records."""
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    rewards = ["--reward-module", cfg.task.reward_module] if cfg.task.reward_module else []
    actor = spawn("actor", "--connect", cfg.server.bind, "--metrics-port", "0", "--model-dir", str(run_dir), *rewards,
                  name="actor")
    assert learner.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=30) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_chat_template_r1_rewards_with_lora(run_config, spawn):
    # num_train/num_eval from the defaults change nothing here: a jsonl task trains on the
    # whole train file, and the bundled eval file has only 8 examples.
    config, cfg = run_config(
        lora={"enabled": True, "rank": 4},
        generation={"max_tokens": 16},
        task={
            "name": "jsonl",
            "train_path": "builtin:gsm8k_mini",
            "eval_path": "builtin:gsm8k_mini_eval",
            "rewards": ["r1_format", "r1_accuracy", "reverse_positions"],
            "reward_weights": [0.5, 1.0, 0.1],
            "chat_template": True,
            "system_prompt": "Answer in <answer></answer>.",
        },
        train={"steps": 4, "checkpoint_every": 2},
    )
    run_dir = Path(cfg.run_dir)
    records = train_with_one_actor(spawn, config, cfg)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # reverse_positions gives partial credit, so groups differ and the batch trains
    assert all(r["groups"] == 2 for r in records)

    checkpoint = latest_checkpoint(run_dir)
    assert (checkpoint / "adapters.safetensors").exists()
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    model, tokenizer = mlx_lm.load(adapter_config["model"], adapter_path=str(checkpoint))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2?"}], add_generation_prompt=True, tokenize=False)
    assert_checkpoint_generates_like_the_learner(checkpoint, prompt, max_tokens=4)


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
    # Against the whole worked solution a random model's groups rarely differ in R1 reward, so most were
    # dropped as uninformative and the actor generated for up to a minute; with `brevity` its groups differ.
    rewards_file = tmp_path / "rewards.py"
    rewards_file.write_text("from grpo_fleet.tasks import register_reward\n" + BREVITY_REWARD)
    config, cfg = run_config(
        lora={"enabled": True, "rank": 4},
        generation={"max_tokens": 16},
        task={
            "name": "dataset", "dataset": str(dataset_dir), "eval_split": "test",
            "prompt_column": "messages", "answer_column": "solution", "reward_module": str(rewards_file),
            "rewards": ["r1_format", "r1_accuracy", "reverse_positions", "brevity"],
            "reward_weights": [0.5, 1.0, 0.1, 0.1],
        },
        optim=optim,
        # One group a step: the schedule is what this test is about.
        grpo={"groups_per_step": 1},
        train={"steps": 4, "checkpoint_every": 2},
    )
    run_dir = Path(cfg.run_dir)
    records = train_with_one_actor(spawn, config, cfg)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # The optimizer state of the last checkpoint holds the schedule's place: 4 updates, at the rate of the 4th.
    state = mx.load(str(latest_checkpoint(run_dir) / "optimizer.safetensors"))
    assert int(state["step"]) == 4
    # decay_steps defaults to the 4 steps minus 2 of warm-up.
    schedule = learning_rate_schedule(OptimConfig(**optim, decay_steps=2))
    assert float(state["learning_rate"]) == pytest.approx(float(schedule(mx.array(3, mx.uint64))), rel=1e-6)
