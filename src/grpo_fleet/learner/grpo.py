"""The GRPO objective as pure functions over `mx.array`s.

Everything here is side-effect free: arrays in, arrays out, so the learner can
wrap `grpo_loss` in `nn.value_and_grad` and the tests can compare each piece
against a float64 NumPy reference.

Conventions: token tensors are `[B, T]` (one row per completion, `T` the padded
completion length), `mask` marks the completion tokens that count, and
advantages are one scalar per completion, `[B]`.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")

Axis = Optional[Union[int, tuple[int, ...]]]


def _as_float(x: mx.array) -> mx.array:
    """Cast to float32 unless already a floating type of at least 32 bits."""
    if x.dtype in (mx.float32, mx.float64):
        return x
    return x.astype(mx.float32)


def _grouped(rewards: mx.array, group_size: int) -> mx.array:
    """Reshape flat `[N]` rewards into `[N / group_size, group_size]`."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {rewards.shape}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"{n} rewards are not divisible into groups of {group_size}")
    return _as_float(rewards).reshape(n // group_size, group_size)


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


def kl_k3(logprobs: mx.array, ref_logprobs: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(pi || pi_ref): `exp(d) - d - 1`, `d = ref - lp`.

    Unbiased for samples from pi and always >= 0, unlike the plain log ratio.
    """
    d = ref_logprobs - logprobs
    return mx.exp(d) - d - 1.0


def masked_mean(x: mx.array, mask: mx.array, axis: Axis = None) -> mx.array:
    """Mean of `x` over the positions where `mask` is set; 0 where nothing is.

    The denominator is clamped to 1 so an empty selection gives 0, not NaN.
    """
    m = _as_float(mask)
    return mx.sum(x * m, axis=axis) / mx.maximum(mx.sum(m, axis=axis), 1.0)


def _token_mean(x: mx.array, m: mx.array, total_tokens: Optional[mx.array]) -> mx.array:
    """Mean over masked tokens; with `total_tokens`, this slice's share of the batch-wide mean."""
    if total_tokens is None:
        return masked_mean(x, m)
    return mx.sum(x * m) / mx.maximum(total_tokens, 1.0)


def _aggregate(
    x: mx.array,
    m: mx.array,
    loss_type: str,
    max_tokens: Optional[int],
    total_tokens: Optional[mx.array] = None,
    total_sequences: Optional[mx.array] = None,
) -> mx.array:
    """Reduce per-token values `[B, T]` to a scalar the way `loss_type` prescribes.

    With the batch totals given, the result is this micro-batch's additive share
    of the whole batch's value, so summing the shares over micro-batches gives
    exactly the one-batch loss (a sequence is never split across micro-batches).
    """
    sequences = x.shape[0] if total_sequences is None else total_sequences
    if loss_type in ("grpo", "gspo"):
        # Each completion weighs the same regardless of its length.
        return mx.sum(masked_mean(x, m, axis=1)) / sequences
    if loss_type == "dapo":
        # Each token weighs the same across the batch.
        return _token_mean(x, m, total_tokens)
    # dr_grpo: a constant denominator removes the length bias entirely.
    assert max_tokens is not None  # checked by the caller (_check_loss_args)
    return mx.sum(x * m) / (sequences * max_tokens)


def _check_loss_args(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    ref_logprobs: Optional[mx.array],
    beta: float,
    loss_type: str,
    max_tokens: Optional[int],
) -> None:
    """Raise ValueError for inconsistent shapes or option combinations."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type == "dr_grpo" and (max_tokens is None or max_tokens < 1):
        raise ValueError("loss_type 'dr_grpo' needs a positive max_tokens")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {logprobs.shape}")
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs}
    for name, arr in named.items():
        if arr is not None and arr.shape != logprobs.shape:
            raise ValueError(f"{name} shape {arr.shape} != logprobs shape {logprobs.shape}")
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(f"advantages shape {advantages.shape} != ({logprobs.shape[0]},)")


# Log-ratios are clamped to +-20 before exp (verl does the same): a ratio past
# e^20 = 4.9e8 carries no signal, and exp of a larger one overflows float32, so
# one token with a stale or hostile old logprob could make the loss inf.
MAX_LOG_RATIO = 20.0


def _bounded_exp(log_ratio: mx.array) -> mx.array:
    return mx.exp(mx.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _ratio(log_ratio: mx.array, m: mx.array, loss_type: str) -> mx.array:
    """Importance ratio per token: token-level, or GSPO's broadcast sequence ratio."""
    if loss_type == "gspo":
        # Geometric mean of the token ratios over the completion's own tokens.
        seq = _bounded_exp(masked_mean(log_ratio, m, axis=1))
        return mx.broadcast_to(seq[:, None], log_ratio.shape)
    return _bounded_exp(log_ratio)


def grpo_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    *,
    ref_logprobs: Optional[mx.array] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    loss_type: str = "grpo",
    max_tokens: Optional[int] = None,
    total_tokens: Optional[mx.array] = None,
    total_sequences: Optional[mx.array] = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Clipped-surrogate GRPO loss (to minimise) and detached scalar stats.

    Per token: `o = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) - beta * k3`,
    aggregated per `loss_type` ("grpo", "dapo", "dr_grpo", "gspo") and negated.
    Stats: `clip_fraction`, `kl`, `policy_objective`, `ratio_mean`.

    `total_tokens` / `total_sequences` are the whole batch's completion-token and
    sequence counts when these rows are one micro-batch of it: the loss and every
    stat are then this micro-batch's share, and the shares sum to the batch value.
    """
    _check_loss_args(
        logprobs, old_logprobs, advantages, mask, ref_logprobs, beta, loss_type, max_tokens
    )
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = mask.astype(mx.float32)
    on = m != 0
    lp = _as_float(logprobs)
    # Padding positions may hold garbage log-probs; zero their log ratio so exp()
    # cannot overflow into inf * 0 = NaN (in the value or the gradient).
    log_ratio = mx.where(on, lp - _as_float(old_logprobs), 0.0)
    ratio = _ratio(log_ratio, m, loss_type)
    adv = _as_float(advantages)[:, None]
    clipped = mx.clip(ratio, 1.0 - epsilon_low, 1.0 + eps_high)
    surrogate = mx.minimum(ratio * adv, clipped * adv)

    objective = surrogate
    k3 = None
    if ref_logprobs is not None:
        # Same guard: masked positions compare 0 with 0 and give k3 = 0.
        k3 = kl_k3(mx.where(on, lp, 0.0), mx.where(on, _as_float(ref_logprobs), 0.0))
        if beta > 0:
            objective = surrogate - beta * k3
    totals = (total_tokens, total_sequences)
    loss = -_aggregate(objective, m, loss_type, max_tokens, *totals)
    stats = _loss_stats(ratio, surrogate, k3, m, (epsilon_low, eps_high), loss_type, max_tokens, totals)
    return loss, stats


def _loss_stats(
    ratio: mx.array,
    surrogate: mx.array,
    k3: Optional[mx.array],
    m: mx.array,
    epsilons: tuple[float, float],
    loss_type: str,
    max_tokens: Optional[int],
    totals: tuple[Optional[mx.array], Optional[mx.array]],
) -> dict[str, mx.array]:
    """Monitoring scalars, detached so that returning them never changes gradients."""
    ratio = mx.stop_gradient(ratio)
    surrogate = mx.stop_gradient(surrogate)
    tokens = totals[0]
    outside = (ratio < 1.0 - epsilons[0]) | (ratio > 1.0 + epsilons[1])
    kl = mx.array(0.0) if k3 is None else _token_mean(mx.stop_gradient(k3), m, tokens)
    return {
        "clip_fraction": _token_mean(outside.astype(mx.float32), m, tokens),
        "kl": kl,
        "policy_objective": _aggregate(surrogate, m, loss_type, max_tokens, *totals),
        "ratio_mean": _token_mean(ratio, m, tokens),
    }
