"""The GSM8K recipe of docs/several-macs.md (configs/qwen2.5-0.5b-gsm8k-mac.toml) made to run on the self-built tiny model.

Shared by the recipe test and the test that launches the shipped deploy/fleet.toml,
which runs that recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from datasets import Dataset, DatasetDict

from grpo_fleet.config import load_run_config
from grpo_fleet.tasks import data_path

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-0.5b-gsm8k-mac.toml"
# A user reward for the tiny model, appended to a reward file. On GSM8K's questions it earns no R1 credit, and a
# reverse_positions point against their answers in about one group of thirty, so nearly all its groups would score
# alike and be skipped for zero variance (97% measured): its actors generated some 60 groups for each one trained.
# Its completions' lengths differ within a group, so with this reward its groups differ, and train.
BREVITY_REWARD = '''

@register_reward
def brevity(completion, prompt, **columns):
    """Fewer characters score higher: 1 / (1 + length)."""
    return 1.0 / (1.0 + len(completion))
'''


def gsm8k_like(path: Path, first_level: int) -> Dataset:
    """GSM8K's columns (question, answer) from a packaged JSONL, plus a `level` column user rewards may read."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Dataset.from_dict({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows],
                              "level": [first_level + i for i in range(len(rows))]})


def save_gsm8k_like(directory: Path) -> Path:
    """A `save_to_disk` dataset in GSM8K's shape (train levels 0.., test levels 100..)."""
    DatasetDict({"train": gsm8k_like(data_path("gsm8k_mini.jsonl"), 0),
                 "test": gsm8k_like(data_path("gsm8k_mini_eval.jsonl"), 100)}).save_to_disk(str(directory))
    return directory


def recipe_config(tmp_path: Path, free_port: Callable[[], int], dataset: Path, rewards_file: Path,
                  rewards: dict[str, float]) -> tuple[Path, dict]:
    """The recipe's config with only what the tiny model and this machine need changed (`rewards`: name -> weight)."""
    overrides = {
        "run_dir": str(tmp_path / "run"), "model.path": "tiny", "task.dataset": str(dataset), "task.num_eval": 4,
        "task.reward_module": str(rewards_file), "task.rewards": list(rewards),
        "task.reward_weights": list(rewards.values()), "lora.rank": 4, "lora.num_layers": -1,
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
