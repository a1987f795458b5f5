"""The README's GSM8K recipe (configs/qwen2.5-0.5b-gsm8k-mac.toml) end to end on the self-built tiny model.

A local `datasets` dataset in GSM8K's shape, a user reward file, eval leases and
samples, real processes; an actor with a different copy of the reward file is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

from grpo_fleet.config import load_run_config
from grpo_fleet.tasks import data_path
from helpers import audit_ledger, jsonl

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-0.5b-gsm8k-mac.toml"
USER_REWARDS = '''
from grpo_fleet.tasks import register_reward

@register_reward
def by_level(completion, prompt, *, answer, level, **columns):
    """A reward that reads a dataset column: every completion of a level-n question scores 0.001 * (n + 1)."""
    return 0.001 * (level + 1)
'''


def gsm8k_like(path: Path, first_level: int) -> Dataset:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Dataset.from_dict({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows],
                              "level": [first_level + i for i in range(len(rows))]})


def recipe_config(tmp_path: Path, free_port, dataset: Path, rewards_file: Path) -> tuple[Path, dict]:
    """The recipe's config with only what the tiny model and this machine need changed."""
    overrides = {
        "run_dir": str(tmp_path / "run"), "model.path": "tiny", "task.dataset": str(dataset), "task.num_eval": 4,
        "task.reward_module": str(rewards_file), "task.rewards": ["r1_format", "r1_accuracy", "by_level", "reverse_positions"],
        # reverse_positions: partial credit, so a random model's groups differ and train.
        "task.reward_weights": [0.2, 1.0, 1.0, 0.1], "lora.rank": 4, "lora.num_layers": -1,
        "generation.group_size": 4, "generation.max_tokens": 12, "grpo.groups_per_step": 2,
        "train.steps": 4, "train.checkpoint_every": 2, "train.eval_every": 2, "train.eval_samples": 2,
        "train.log_samples_every": 1, "server.bind": f"tcp://127.0.0.1:{free_port()}",
        "server.pub_bind": f"tcp://127.0.0.1:{free_port()}", "server.lease_seconds": 60.0, "metrics.port": 0,
    }
    cfg = load_run_config(RECIPE, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])
    path = tmp_path / "recipe.json"
    data = cfg.model_dump(mode="json")
    path.write_text(json.dumps(data))
    return path, data


def test_the_gsm8k_recipe_trains_with_user_rewards_eval_leases_and_samples(spawn, free_port, tmp_path):
    dataset = tmp_path / "gsm8k"
    DatasetDict({"train": gsm8k_like(data_path("gsm8k_mini.jsonl"), 0),
                 "test": gsm8k_like(data_path("gsm8k_mini_eval.jsonl"), 100)}).save_to_disk(str(dataset))
    rewards_file = tmp_path / "my_rewards.py"
    rewards_file.write_text(USER_REWARDS)
    config, cfg = recipe_config(tmp_path, free_port, dataset, rewards_file)
    assert cfg["train"]["eval_mode"] == "sampled" and cfg["task"]["chat_template"], "the recipe's own settings"
    run_dir = Path(cfg["run_dir"])
    learner = spawn("learner", "--config", str(config), name="learner")

    # Another Mac with an edited copy of the reward file is refused, and says why.
    edited = tmp_path / "edited" / "my_rewards.py"
    edited.parent.mkdir()
    edited.write_text(USER_REWARDS.replace("0.001", "0.002"))
    stale_copy = spawn("actor", "--connect", cfg["server"]["bind"], "--metrics-port", "0", "--model-dir", str(run_dir),
                       "--reward-module", str(edited), name="stale-actor")
    assert stale_copy.wait(timeout=120) != 0
    assert "differs from the learner's" in stale_copy.log_path.read_text()

    actor = spawn("actor", "--connect", cfg["server"]["bind"], "--metrics-port", "0", "--model-dir", str(run_dir),
                  "--reward-module", str(rewards_file), name="actor")
    assert learner.wait(timeout=300) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=60) == 0, actor.log_path.read_text()[-3000:]

    lines = jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in lines if "event" not in r]
    rounds = [r for r in lines if r.get("event") == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in rounds] == [0, 2, 4], "step 0, every eval_every, and the end"
    for round_ in rounds:
        assert (round_["scored"], round_["k"], round_["mode"]) == (4, 2, "sampled")
        # The held-out levels are 100..103: by_level alone gives 0.101..0.104 (the tiny model earns no R1 credit).
        assert 0.101 - 1e-6 <= round_["eval_reward"]
    assert len(audit_ledger(run_dir / "ledger.jsonl").accepted) >= 8, "eval work never enters the ledger"

    samples = jsonl(run_dir / "samples.jsonl")
    assert {row["step"] for row in samples} == {1, 2, 3, 4}
    for row in samples:
        assert row["reward"] >= 0.001 * (row["prompt_index"] + 1) - 1e-6, "the user's reward read the level column"
        assert row["completion"] and row["prompt"]
