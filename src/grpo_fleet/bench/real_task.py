"""The real pretrained model and the task the real-model benchmarks train it on.

The model is SmolLM2-135M-Instruct as an fp32 mlx-lm directory
(`real_model_dir`). The task is a run config: a TOML file when one is given
(`GRPO_FLEET_REAL_TASK_CONFIG`, the demo-real task), else a built-in stand-in,
`addition_config`: "What is A + B?" under the chat template, rewarded 1.0 when
the first integer of the reply is A + B. The model is weak at it (it answers
"12 + 7 = 9", or restates the sum before answering), so groups have mixed
rewards from the first step. Either way the model, run directory, seed and step
budget are set here, and every other setting comes from the config.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.config import RunConfig, apply_overrides, load_run_config
from grpo_fleet.launch.demo import DemoOptions, demo_settings

REAL_TASK_CONFIG_ENV = "GRPO_FLEET_REAL_TASK_CONFIG"
# The demo-real task's config (relative to where `make bench` runs) once it lands; None means the stand-in.
DEMO_REAL = "demo-real"  # `make demo-real`'s packaged task (grpo_fleet/demos/smollm2-135m-instruct)
DEFAULT_REAL_TASK_CONFIG: Optional[str] = DEMO_REAL
_INTEGER = re.compile(r"-?\d+")

# The stand-in's settings: the LoRA (r16, scale 20, lr 2e-5) and a batch small enough for 2 cores.
ADDITION_SETTINGS: dict[str, Any] = {
    "lora": {"enabled": True, "rank": 16, "scale": 20.0},
    "optim": {"lr": 2e-5},
    "generation": {"group_size": 4, "max_tokens": 16, "temperature": 1.0},
    "grpo": {"beta": 0.0, "groups_per_step": 4},
    "task": {
        "name": "jsonl", "chat_template": True, "rewards": ["first_integer_is_answer"],
        "reward_module": "grpo_fleet.bench.real_task", "num_eval": 32,
        "system_prompt": "Answer with the number only.",
    },
    "model": {"dtype": "float32"},
}


def real_model_dir() -> str:
    """The real model's mlx-lm directory: $GRPO_FLEET_REAL_MODEL, else SmolLM2-135M-Instruct from the zoo."""
    from grpo_fleet.bench.real_decode import real_model_dir as resolve

    return str(resolve())


def real_task_config() -> Optional[str]:
    """The real-model task's config file: $GRPO_FLEET_REAL_TASK_CONFIG, else DEFAULT_REAL_TASK_CONFIG; None means
    the addition stand-in."""
    return os.environ.get(REAL_TASK_CONFIG_ENV) or DEFAULT_REAL_TASK_CONFIG


def first_integer(text: str) -> Optional[int]:
    """The first integer written in `text` (a leading minus sign included), or None."""
    found = _INTEGER.search(text)
    return int(found.group()) if found else None


def first_integer_is_answer(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """1.0 when the reply's first integer is the answer, else 0.0 (the stand-in task's reward)."""
    return 1.0 if first_integer(completion) == int(answer) else 0.0


def addition_rows(count: int, seed: int, high: int) -> list[dict[str, str]]:
    """`count` distinct {prompt, answer} rows "What is A + B?" with 0 <= A, B <= high, in a seeded order."""
    pairs = [(a, b) for a in range(high + 1) for b in range(high + 1)]
    if count > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct sums with operands up to {high}; asked for {count}")
    chosen = random.Random(seed).sample(pairs, count)
    return [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in chosen]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def addition_config(run_dir: Path, *, num_train: int = 256, num_eval: int = 32, high: int = 20) -> dict[str, Any]:
    """The stand-in task's config data, its train and held-out JSONL written under `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = addition_rows(num_train + num_eval, seed=0, high=high)
    task = {**ADDITION_SETTINGS["task"], "num_eval": num_eval,
            "train_path": _write_jsonl(run_dir / "addition-train.jsonl", rows[:num_train]),
            "eval_path": _write_jsonl(run_dir / "addition-eval.jsonl", rows[num_train:])}
    return {**ADDITION_SETTINGS, "task": task}


def real_config(run_dir: Path, *, model_dir: str, seed: int, steps: int, config_path: Optional[str] = None,
                overrides: Optional[list[str]] = None) -> RunConfig:
    """The run config of a real-model benchmark: `config_path`'s task (or the stand-in) on `model_dir`."""
    if config_path is None:
        data = addition_config(run_dir)
    elif config_path == DEMO_REAL:  # the packaged demo: its data and reward paths are taken from its own folder
        data = demo_settings(DemoOptions(model="smollm2-135m-instruct"))
    else:
        data = load_run_config(config_path).model_dump(mode="json")
    cfg = RunConfig.model_validate(data)
    train = cfg.train.model_copy(update={"steps": steps, "seed": seed, "eval_every": 0, "log_samples_every": 0})
    cfg = cfg.model_copy(update={"run_dir": str(run_dir), "train": train,
                                 "model": cfg.model.model_copy(update={"path": model_dir})})
    if overrides:
        cfg = RunConfig.model_validate(apply_overrides(cfg.model_dump(mode="json"), overrides))
    return cfg
