"""Rewards to advantages, as pure functions over `mx.array`s: group-relative advantages and DAPO's overlong penalty.

Side-effect free like the loss (grpo.py), and checked the same way against a
float64 NumPy reference. Rewards are flat `[N]`, in contiguous groups of `group_size`.
"""

from __future__ import annotations

import mlx.core as mx

from grpo_fleet.learner.step.grpo import as_float


def _grouped(rewards: mx.array, group_size: int) -> mx.array:
    """Reshape flat `[N]` rewards into `[N / group_size, group_size]`."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {rewards.shape}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"{n} rewards are not divisible into groups of {group_size}")
    return as_float(rewards).reshape(n // group_size, group_size)


def group_advantages(
    rewards: mx.array,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-4,
) -> mx.array:
    """Group-relative advantages: `(r - mean_g) / (std_g + eps)` per contiguous group.

    `std_g` is the population std (ddof=0). With `scale_by_std=False` (Dr. GRPO)
    the result is just `r - mean_g`. Returns a flat `[N]` array.
    """
    g = _grouped(rewards, group_size)
    mean = mx.mean(g, axis=1, keepdims=True)
    centered = g - mean
    if scale_by_std:
        std = mx.sqrt(mx.mean(centered * centered, axis=1, keepdims=True))
        centered = centered / (std + eps)
    # mean() of identical floats can round to a value a hair off the inputs, which
    # would leak a tiny nonzero signal from a group that carries none; decide
    # "no variance" by exact comparison instead.
    flat = mx.max(g, axis=1, keepdims=True) == mx.min(g, axis=1, keepdims=True)
    return mx.where(flat, mx.zeros_like(centered), centered).reshape(-1)


def overlong_penalty(lengths: mx.array, max_tokens: int, buffer: int, factor: float) -> mx.array:
    """DAPO's soft overlong punishment, `[N]`, to add to the rewards before advantages.

    0 up to `max_tokens - buffer` tokens, then falling linearly to `-factor` at
    `max_tokens` (and no lower): `-factor * clip((len - (max_tokens - buffer)) / buffer, 0, 1)`.
    """
    if not 0 < buffer < max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens = {max_tokens}), got {buffer}")
    if factor < 0:
        raise ValueError(f"overlong penalty factor must be >= 0, got {factor}")
    excess = (as_float(lengths) - (max_tokens - buffer)) / buffer
    return -factor * mx.clip(excess, 0.0, 1.0)
