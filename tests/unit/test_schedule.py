"""The learning-rate schedule: values per update, defaults, and the optimizer carrying it."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from pydantic import ValidationError

from grpo_fleet.config import OptimConfig, RunConfig
from grpo_fleet.learner.step.schedule import learning_rate_schedule, with_decay_steps

LR = 1e-3


def rates(cfg: OptimConfig, updates: int) -> list[float]:
    schedule = learning_rate_schedule(cfg)
    return [float(schedule(mx.array(step, mx.uint64))) for step in range(updates)]


def test_constant_without_warmup_is_a_plain_rate() -> None:
    assert learning_rate_schedule(OptimConfig(lr=LR)) == LR


def test_warmup_rises_to_lr_without_a_zero_step_then_holds() -> None:
    got = rates(OptimConfig(lr=LR, warmup_steps=4), 7)
    assert got == pytest.approx([0.25 * LR, 0.5 * LR, 0.75 * LR, LR, LR, LR, LR])


def test_single_warmup_step_is_full_rate() -> None:
    assert rates(OptimConfig(lr=LR, warmup_steps=1), 2) == pytest.approx([LR, LR])


def test_linear_decay_reaches_min_lr_and_stays() -> None:
    got = rates(OptimConfig(lr=LR, schedule="linear", decay_steps=10, min_lr=1e-4), 13)
    assert got[0] == pytest.approx(LR)
    assert got[5] == pytest.approx((LR + 1e-4) / 2)
    assert got[10:] == pytest.approx([1e-4] * 3)


def test_cosine_after_warmup_starts_at_lr_and_ends_at_min_lr() -> None:
    cfg = OptimConfig(lr=LR, schedule="cosine", warmup_steps=2, decay_steps=8, min_lr=0.0)
    got = rates(cfg, 12)
    assert got[:2] == pytest.approx([0.5 * LR, LR])
    assert got[2] == pytest.approx(LR)
    assert got[2 + 4] == pytest.approx(LR / 2)  # halfway through the cosine
    assert got[2 + 2] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi / 4)))
    assert got[10:] == pytest.approx([0.0, 0.0], abs=1e-12)


def test_decay_needs_decay_steps() -> None:
    with pytest.raises(ValueError, match="decay_steps"):
        learning_rate_schedule(OptimConfig(schedule="cosine"))


def test_decay_steps_default_to_the_updates_after_warmup() -> None:
    cfg = RunConfig.model_validate(
        {"train": {"steps": 200}, "grpo": {"ppo_epochs": 2}, "optim": {"schedule": "linear", "warmup_steps": 10}}
    )
    assert with_decay_steps(cfg).decay_steps == 390
    explicit = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"decay_steps": 7})})
    assert with_decay_steps(explicit).decay_steps == 7


def test_min_lr_above_lr_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_lr"):
        OptimConfig(lr=1e-4, min_lr=1e-3)


def test_adamw_keeps_the_scheduled_rate_in_its_state() -> None:
    """After k updates the state holds the rate update k-1 used, and `step` = k: what resume relies on."""
    cfg = OptimConfig(lr=LR, schedule="linear", warmup_steps=2, decay_steps=4)
    model = nn.Linear(2, 1)
    optimizer = optim.AdamW(learning_rate=learning_rate_schedule(cfg))
    expected = rates(cfg, 5)
    for update in range(5):
        grads = {k: mx.ones_like(v) for k, v in model.trainable_parameters().items()}
        optimizer.update(model, grads)
        assert int(optimizer.state["step"]) == update + 1
        assert float(optimizer.learning_rate) == pytest.approx(expected[update])
