"""The learning-rate schedule an OptimConfig names, built from mlx.optimizers schedules."""

from __future__ import annotations

from typing import Callable, Union

import mlx.core as mx
import mlx.optimizers as optim

from grpo_fleet.config import OptimConfig, RunConfig

Schedule = Callable[[mx.array], mx.array]


def learning_rate_schedule(cfg: OptimConfig) -> Union[float, Schedule]:
    """What AdamW's `learning_rate` gets: a plain rate, or a schedule of the optimizer's update count.

    mlx optimizers evaluate a schedule at their `step` (updates applied so far)
    and keep both in their state, so saving and loading that state resumes the
    schedule exactly where it stopped.
    """
    if cfg.schedule == "constant" and cfg.warmup_steps == 0:
        # A plain float keeps the optimizer state exactly what it was before schedules existed.
        return cfg.lr
    main = _after_warmup(cfg)
    if cfg.warmup_steps == 0:
        return main
    # Update k (from 0) of the warm-up runs at lr * (k + 1) / N, so none is wasted at rate 0 and update N-1 is at lr.
    warmup = optim.linear_schedule(cfg.lr / cfg.warmup_steps, cfg.lr, max(cfg.warmup_steps - 1, 1))
    return optim.join_schedules([warmup, main], [cfg.warmup_steps])


def _after_warmup(cfg: OptimConfig) -> Schedule:
    if cfg.schedule == "constant":
        return optim.linear_schedule(cfg.lr, cfg.lr, 1)
    if cfg.decay_steps is None:
        raise ValueError(f"optim.schedule = {cfg.schedule!r} needs optim.decay_steps (trainer_from_config fills it in)")
    if cfg.schedule == "linear":
        return optim.linear_schedule(cfg.lr, cfg.min_lr, cfg.decay_steps)
    return optim.cosine_decay(cfg.lr, cfg.decay_steps, cfg.min_lr)


def with_decay_steps(cfg: RunConfig) -> OptimConfig:
    """The run's OptimConfig with decay_steps defaulted to the updates left after warm-up."""
    optim_cfg = cfg.optim
    if optim_cfg.decay_steps is not None:
        return optim_cfg
    updates = cfg.train.steps * cfg.grpo.ppo_epochs
    return optim_cfg.model_copy(update={"decay_steps": max(1, updates - optim_cfg.warmup_steps)})
