"""Log-probabilities of sampled tokens, as pure functions over `mx.array`s, in float32.

The one convention actors and learner share: log_softmax(logits / T) at the
sampled token. `chunked_logprobs` computes it from hidden states a chunk of
positions at a time, so logits of shape `[N, L, V]` never exist.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import mlx.core as mx
from mlx.utils import tree_unflatten

from grpo_fleet.learner.step import vector_exp
from grpo_fleet.runtime.trees import flat_leaves


def token_logprobs(logits: mx.array, targets: mx.array) -> mx.array:
    """Log-probability of each target token, `[B, T]`, from aligned `[B, T, V]` logits.

    Computed as `logit[target] - logsumexp(logits)` in float32: half-precision
    softmax loses too much on large vocabularies, and gathering before
    subtracting avoids materialising a full `[B, T, V]` log-softmax.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} do not align with targets {targets.shape}")
    logits = logits.astype(mx.float32)
    lse = vector_exp.logsumexp(logits)
    picked = mx.take_along_axis(logits, targets.astype(mx.int32)[..., None], axis=-1)
    return picked.squeeze(-1) - lse


def head_logprobs(logits: mx.array, targets: mx.array, temperature: float) -> mx.array:
    """Logprobs of `targets` under log_softmax(logits / T) in fp32: the actors' convention."""
    logits = logits.astype(mx.float32)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, targets)


def _logprob_cotangent(logits: mx.array, targets: mx.array, cotangent: mx.array, temperature: float) -> mx.array:
    """d loss / d logits for lp = log_softmax(logits / T)[target]: `g * (onehot - softmax) / T`.

    Written out (instead of autodiff through logsumexp and the gather) so one
    chunk's backward holds about three `[chunk, V]` buffers, not eight.
    """
    z = logits.astype(mx.float32)
    if temperature != 1.0:
        z = z / temperature
    soft = mx.softmax(z, axis=-1, precise=True)
    index = targets.astype(mx.int32)[:, None]
    at_target = cotangent[:, None] * (1.0 - mx.take_along_axis(soft, index, axis=-1))
    dz = mx.put_along_axis(-cotangent[:, None] * soft, index, at_target, axis=-1)
    if temperature != 1.0:
        dz = dz / temperature
    return dz.astype(logits.dtype)


def chunked_logprobs(
    hidden: mx.array,
    targets: mx.array,
    project: Callable[[Any, mx.array], mx.array],
    params: Any,
    *,
    temperature: float,
    chunk_size: int,
) -> mx.array:
    """Target logprobs `[K]` from hidden states `[K, D]`, `chunk_size` positions at a time.

    `project(params, h)` is the LM head; `params` are its trainable weights (a
    tree, possibly empty), passed explicitly so they receive gradients. Like
    `mx.checkpoint`, the backward recomputes each chunk's `[chunk, V]` logits
    instead of keeping them, and `mx.depends` chains the chunks so they run one
    after another in both passes: at most one chunk's logits exist at a time.
    Without the chain, MLX's breadth-first evaluation would hold many at once.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree on K")
    keys = [key for key, _ in flat_leaves(params)]
    spans = [(start, min(start + chunk_size, hidden.shape[0])) for start in range(0, hidden.shape[0], chunk_size)]
    if not spans:
        return mx.zeros((0,), dtype=mx.float32)

    def logits_of(h: mx.array, *weights: mx.array) -> mx.array:
        return project(tree_unflatten(list(zip(keys, weights))), h)

    @mx.custom_function
    def run(h_all: mx.array, t_all: mx.array, *weights: mx.array) -> mx.array:
        parts: list[mx.array] = []
        for start, end in spans:
            h = h_all[start:end] if not parts else mx.depends(h_all[start:end], parts[-1])
            parts.append(head_logprobs(logits_of(h, *weights), t_all[start:end], temperature))
        return mx.concatenate(parts)

    @run.vjp
    def run_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
        h_all, t_all, *weights = primals
        d_hidden: list[mx.array] = []
        d_weights: Optional[list[mx.array]] = None
        for start, end in spans:
            h = h_all[start:end] if not d_hidden else mx.depends(h_all[start:end], d_hidden[-1])
            dz = _logprob_cotangent(logits_of(h, *weights), t_all[start:end], cotangent[start:end], temperature)
            _, grads = mx.vjp(logits_of, [h, *weights], [dz])
            d_hidden.append(grads[0])
            d_weights = grads[1:] if d_weights is None else [a + b for a, b in zip(d_weights, grads[1:])]
        return (mx.concatenate(d_hidden), mx.zeros_like(t_all), *(d_weights or []))

    return cast(mx.array, run(hidden, targets, *[value for _, value in flat_leaves(params)]))
