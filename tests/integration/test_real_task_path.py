"""The GSM8K-style path end to end: JSONL data, chat template, R1 rewards, LoRA, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx_lm

from grpo_fleet.model import latest_checkpoint


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
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--metrics-port", "0", "--model-dir", str(run_dir), name="actor")
    assert learner.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=30) == 0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # reverse_positions gives partial credit, so groups differ and the batch trains
    assert all(r["groups"] == 2 for r in records)

    checkpoint = latest_checkpoint(run_dir)
    assert (checkpoint / "adapters.safetensors").exists()
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    model, tokenizer = mlx_lm.load(adapter_config["model"], adapter_path=str(checkpoint))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2?"}], add_generation_prompt=True, tokenize=False)
    assert isinstance(mlx_lm.generate(model, tokenizer, prompt, max_tokens=4), str)
