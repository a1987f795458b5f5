"""Held-out evaluation in this process: completions of eval prompts, scored by the task's rewards.

The learner uses it for an eval round when no actor is connected
(learner/evals/evaluation.py); the benchmarks use `evaluate` on checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.config import RunConfig
from grpo_fleet.models.generation import SamplingSettings, completion_text, generate_groups
from grpo_fleet.tasks import Example, Task
from grpo_fleet.tasks.prompts import encode_prompt
from grpo_fleet.tasks.reward_runner import InlineScorer, Scorer


def sample_and_score(model: nn.Module, tokenizer: Any, task: Task, cfg: RunConfig, examples: Sequence[Example],
                     scorer: Scorer, *, samples: int = 1, temperature: float = 0.0,
                     batch_size: int = 64) -> list[Optional[list[float]]]:
    """Each example's `samples` rewards (temperature 0 = greedy), or None where a reward failed."""
    eos = set(tokenizer.eos_token_ids)
    settings = SamplingSettings(group_size=samples, max_tokens=cfg.generation.max_tokens, temperature=temperature,
                                stop_token_ids=sorted(eos))
    results: list[Optional[list[float]]] = []
    rows = max(1, batch_size // samples)
    for start in range(0, len(examples), rows):
        chunk = examples[start : start + rows]
        prompts = [
            encode_prompt(tokenizer, ex.prompt, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt)
            for ex in chunk
        ]
        groups = generate_groups(model, prompts, settings)
        jobs = [task.job(ex, [completion_text(tokenizer, c, eos) for c in group]) for ex, group in zip(chunk, groups)]
        results.extend(score.rewards for score in scorer.score(jobs))
    mx.clear_cache()
    return results


def evaluate(model: nn.Module, tokenizer: Any, task: Task, cfg: RunConfig, *, batch_size: int = 64) -> float:
    """Held-out reward as the learner's eval rounds measure it (train.eval_mode), unscorable prompts left out.

    Greedy: the mean reward of one greedy completion per held-out prompt. Sampled:
    avg@k, the mean over prompts of the mean of train.eval_samples completions at
    train.eval_temperature. A baseline scored any other way than the fleet's own
    rounds would not be comparable (the demo-real task's countries are ones the
    base model already answers greedily).
    """
    greedy = cfg.train.eval_mode == "greedy"
    samples = 1 if greedy else cfg.train.eval_samples
    temperature = 0.0 if greedy else cfg.train.eval_temperature
    scorer = InlineScorer(task.reward_set())
    rewards = [r for r in sample_and_score(model, tokenizer, task, cfg, task.eval, scorer, samples=samples,
                                           temperature=temperature, batch_size=batch_size) if r is not None]
    return sum(sum(r) / len(r) for r in rewards) / max(1, len(rewards))
