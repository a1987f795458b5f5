"""mlx-lm's decoding, where MLX runs on the CPU, through grpo-fleet's native exp (grpo_fleet/native).

MLX's CPU exp is scalar on x86, and a decoding step of a long answer takes the
exp of every attention score against the cache, every MLP unit's SiLU and, to
sample, every vocabulary logit. At 32 rows of SmolLM2-135M with 200 tokens of
context, those made a step 437 ms against 307 with the native kernel
(bench/RESULTS.md). Three pieces, each MLX's own elsewhere (on a GPU, or where
the kernel was not built):

- `decode_attention_function`: mlx-lm's `scaled_dot_product_attention` for one
  query row against the cache, as scores, softmax and values in float32;
- `native_swiglu_function`: mlx-lm's `swiglu` with the native sigmoid;
- `inverse_cdf_sampler`: one token a row by the inverse CDF of the probabilities
  (one exp and one uniform a row), instead of mlx-lm's Gumbel-max, which takes two
  logs of a uniform per vocabulary entry.

mlx-lm's model modules import `scaled_dot_product_attention` and `swiglu` by
name, so `rebind` replaces the name in the module that defines a model's
attention class; `use_native_decoding` does both for the actor. The learner's
chunked attention (learner/step/attention.py) rebinds through it too.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet import native

ORIGINAL_ATTR = "_grpo_fleet_original"


def attention_module(model: nn.Module) -> Any:
    """The module whose attention class calls `scaled_dot_product_attention` (gemma3's is its text model's)."""
    layers = getattr(model, "layers", None)
    attention = getattr(layers[0], "self_attn", None) if layers else None
    return sys.modules.get(type(model if attention is None else attention).__module__)


def rebind(model: nn.Module, name: str, replacement: Callable[[Callable[..., mx.array]], Callable[..., mx.array]],
           restore: bool) -> bool:
    """Rebind `name` in the module that defines `model`'s attention class. The original is kept on the
    replacement, so a second call wraps the original, not the wrapper. Returns whether the module had it."""
    module = attention_module(model)
    current = getattr(module, name, None)
    if module is None or current is None:
        return False
    original = getattr(current, ORIGINAL_ATTR, current)
    if restore:
        setattr(module, name, original)
        return True
    wrapped = replacement(original)
    setattr(wrapped, ORIGINAL_ATTR, original)
    setattr(module, name, wrapped)
    return True


def _decode_mask(mask: mx.array, scores: mx.array, heads: int) -> mx.array:
    """`mask` (bool: keep; or additive), broadcastable to [B, H, 1, T], applied to grouped scores [B, KV, G, T]."""
    batch, kv_heads, group, length = scores.shape
    grouped = mx.broadcast_to(mask, (batch, heads, 1, length)).reshape(batch, kv_heads, group, length)
    if grouped.dtype == mx.bool_:
        return mx.where(grouped, scores, mx.array(-mx.inf, dtype=scores.dtype))
    return scores + grouped.astype(scores.dtype)


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: Optional[Any]) -> mx.array:
    """softmax(q k^T * scale + mask) v for one query row per sequence, q [B, H, 1, d], k and v [B, KV, T, d]."""
    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = (queries.astype(mx.float32) * scale).reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = grouped @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, KV, G, T]
    if mask is not None and not isinstance(mask, str):  # "causal" over one query row masks nothing
        scores = _decode_mask(mask, scores, heads)
    top = mx.max(scores, axis=-1, keepdims=True)
    weights = native.exp(scores - mx.where(mx.isfinite(top), top, 0.0))
    out = (weights @ values.astype(mx.float32)) / mx.sum(weights, axis=-1, keepdims=True)
    return out.reshape(batch, heads, 1, values.shape[-1]).astype(queries.dtype)


def decode_attention_function(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's `scaled_dot_product_attention`, with one-row queries sent to `decode_attention` where the native
    kernel runs. Quantized caches, attention sinks and longer queries (prefill) go to the original."""

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Optional[Any], sinks: Optional[mx.array] = None) -> mx.array:
        if (queries.shape[2] != 1 or queries.dtype != mx.float32 or sinks is not None or hasattr(cache, "bits")
                or not native.active()):  # half precision: mlx-lm's own, as the learner's forward computes it
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return decode_attention(queries, keys, values, scale, mask)

    return attention


def native_swiglu_function(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        return gate * native.sigmoid(gate) * x if native.active() else original(gate, x)
    return swiglu


def use_native_decoding(model: nn.Module, enabled: bool = True) -> None:
    """`model`'s decoding attention and SiLU through the native kernel where it runs (False: back to mlx-lm's).
    Models without a `swiglu` (gemma3's GELU) keep their own MLP."""
    rebind(model, "scaled_dot_product_attention", decode_attention_function, restore=not enabled)
    rebind(model, "swiglu", native_swiglu_function, restore=not enabled)


def inverse_cdf_sampler(logprobs: mx.array) -> mx.array:
    """One token id per row of normalised log-probabilities [B, V]: the first id whose cumulative probability
    passes a uniform draw (scaled by the row's total, which float32 rounding leaves a hair off 1)."""
    cumulative = mx.cumsum(native.exp(logprobs.astype(mx.float32)), axis=-1)
    draw = mx.random.uniform(shape=(logprobs.shape[0], 1)) * cumulative[:, -1:]
    return mx.minimum(mx.sum(cumulative < draw, axis=-1), logprobs.shape[-1] - 1).astype(mx.uint32)
