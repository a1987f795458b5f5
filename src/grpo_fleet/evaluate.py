"""Held-out evaluation: greedy completions of eval prompts, scored by the task's rewards."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.actor.rollout import SamplingSettings, completion_text, generate_groups
from grpo_fleet.config import RunConfig
from grpo_fleet.tasks import Task
from grpo_fleet.tasks.prompts import encode_prompt


def evaluate(model: nn.Module, tokenizer: Any, task: Task, cfg: RunConfig, *, batch_size: int = 64) -> float:
    """Mean reward of greedy completions on the task's held-out examples."""
    eos = set(tokenizer.eos_token_ids)
    settings = SamplingSettings(
        group_size=1, max_tokens=cfg.generation.max_tokens, temperature=0.0, stop_token_ids=sorted(eos)
    )
    scores: list[float] = []
    for start in range(0, len(task.eval), batch_size):
        chunk = task.eval[start : start + batch_size]
        prompts = [
            encode_prompt(tokenizer, ex.prompt, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt)
            for ex in chunk
        ]
        groups = generate_groups(model, prompts, settings)
        for example, (completion,) in zip(chunk, groups):
            scores.append(task.score(completion_text(tokenizer, completion, eos), example))
    mx.clear_cache()
    return sum(scores) / max(1, len(scores))
