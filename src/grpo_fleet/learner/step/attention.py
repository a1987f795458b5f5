"""Causal self-attention in query chunks, for the learner's long rows: half the work, memory linear in length.

mlx-lm's models call `mx.fast.scaled_dot_product_attention(mask="causal")`. On a
long row that computes (and, for its gradient, keeps) the whole `[heads, T, T]`
score matrix, the masked upper half included. On the CPU backend its softmax's
exp is most of a long step: at 572 tokens, attention was two thirds of
SmolLM2's forward (bench `step_flops`).

Here the queries go `chunk` at a time, each against the keys up to its own end,
so the masked half is never computed. The gradient is a custom VJP that
recomputes each chunk's probabilities from the saved row log-sum-exp (as flash
attention does) instead of keeping them: what a layer holds for its backward is
`q, k, v`, the output and one float per query and head, linear in T. The chunks
are chained with `mx.depends`, so at most one chunk's scores exist at a time.
Their exp, forward and backward, is `vector_exp.exp`: on the CPU backend the
native vectorized kernel (or NumPy's, in the forwards without a gradient), where
MLX's is scalar; so is the SiLU of the MLP (`use_vector_swiglu`).

Only the learner's full-row forwards take this path (no cache, `mask="causal"`,
as many queries as keys, no attention sinks). One-row queries against a cache
(the learner's own eval decoding) go to `models.native_functions`' decode path,
and everything else to mlx-lm's own function unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.learner.step import vector_exp
from grpo_fleet.models.native_functions import decode_attention_function, rebind


def _causal_block(start: int, end: int) -> mx.array:
    """Additive mask of the queries start..end against the keys 0..end: -inf above the diagonal."""
    rows = mx.arange(start, end)[:, None]
    cols = mx.arange(end)[None, :]
    return mx.where(cols > rows, mx.array(-mx.inf, dtype=mx.float32), mx.array(0.0, dtype=mx.float32))


def _spans(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def _grouped(q: mx.array, kv_heads: int) -> mx.array:
    """[B, H, T, d] -> [B, KV, H/KV, T, d]: the query heads that share one key/value head side by side."""
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def _scores(q_chunk: mx.array, k: mx.array, end: int, start: int, scale: float) -> mx.array:
    """Scaled, masked scores [B, KV, G, C, end] of a query chunk [B, KV, G, C, d] against keys 0..end."""
    b, kv, g, c, d = q_chunk.shape
    flat = (q_chunk.reshape(b, kv, g * c, d) * scale) @ k[:, :, :end].swapaxes(-1, -2)
    return flat.reshape(b, kv, g, c, end) + _causal_block(start, end).astype(flat.dtype)


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, chunk: int) -> mx.array:
    """softmax(q k^T * scale + causal mask) v for q [B, H, T, d] and k, v [B, KV, T, d] (H a multiple of KV)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    spans = _spans(q.shape[2], chunk)
    kv_heads = k.shape[1]

    @mx.custom_function
    def attend(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        grouped = _grouped(q, kv_heads)
        outs: list[mx.array] = []
        sums: list[mx.array] = []
        for start, end in spans:
            part = grouped[:, :, :, start:end]
            if outs:  # one chunk's scores at a time
                part = mx.depends(part, outs[-1])
            scores = _scores(part, k, end, start, scale)
            top = mx.max(scores, axis=-1, keepdims=True)
            weights = vector_exp.exp(scores - top)
            total = mx.sum(weights, axis=-1, keepdims=True)
            b, kv, g, c, _ = weights.shape
            out = (weights.reshape(b, kv, g * c, end) @ v[:, :, :end]).reshape(b, kv, g, c, -1) / total
            outs.append(out)
            sums.append((top + mx.log(total))[..., 0])
        out = mx.concatenate(outs, axis=3)
        return out.reshape(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), mx.concatenate(sums, axis=3)

    @attend.vjp
    def attend_vjp(primals: list[mx.array], cotangents: Any, outputs: Any) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = primals
        d_out = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        out, log_sums = outputs
        return _backward(q, k, v, _grouped(out, kv_heads), log_sums, _grouped(d_out, kv_heads), spans, scale)

    outputs = cast(tuple[mx.array, mx.array], attend(q, k, v))
    return outputs[0]


def _backward(q: mx.array, k: mx.array, v: mx.array, out: mx.array, log_sums: mx.array, d_out: mx.array,
              spans: list[tuple[int, int]], scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """Flash attention's backward, chunk by chunk: probabilities recomputed from the row log-sum-exp."""
    grouped = _grouped(q, k.shape[1])
    b, kv, g, _, d = grouped.shape
    # delta_i = sum_j P_ij dP_ij = <dO_i, O_i>: the softmax's correction term, per query row
    delta = mx.sum(d_out * out, axis=-1, keepdims=True)
    d_q: list[mx.array] = []
    d_k, d_v = mx.zeros_like(k), mx.zeros_like(v)
    length = k.shape[2]

    def padded(prefix: mx.array) -> mx.array:  # a gradient of keys 0..end, as one of all T keys
        return mx.pad(prefix, [(0, 0), (0, 0), (0, length - prefix.shape[2]), (0, 0)])
    for start, end in spans:
        part = grouped[:, :, :, start:end]
        if d_q:
            part = mx.depends(part, [d_q[-1], d_k, d_v])
        c = end - start
        probs = vector_exp.exp(_scores(part, k, end, start, scale) - log_sums[:, :, :, start:end, None])
        flat_probs = probs.reshape(b, kv, g * c, end)
        grad_out = d_out[:, :, :, start:end].reshape(b, kv, g * c, d)
        d_v = d_v + padded(flat_probs.swapaxes(-1, -2) @ grad_out)
        d_probs = grad_out @ v[:, :, :end].swapaxes(-1, -2)
        d_scores = flat_probs * (d_probs - delta[:, :, :, start:end].reshape(b, kv, g * c, 1)) * scale
        d_q.append((d_scores @ k[:, :, :end]).reshape(b, kv, g, c, d))
        d_k = d_k + padded(d_scores.swapaxes(-1, -2) @ part.reshape(b, kv, g * c, d))
    return mx.concatenate(d_q, axis=3).reshape(q.shape), d_k, d_v


def chunked_attention_function(original: Callable[..., mx.array], chunk: int) -> Callable[..., mx.array]:
    """mlx-lm's `scaled_dot_product_attention`, with full causal rows longer than `chunk` sent to `causal_attention`
    (and one-row queries, the learner's own eval decoding, to the native kernel where it runs)."""
    fallback = decode_attention_function(original)

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Optional[Any], sinks: Optional[mx.array] = None) -> mx.array:
        length = queries.shape[2]
        if (cache is not None or sinks is not None or not isinstance(mask, str) or mask != "causal"
                or keys.shape[2] != length or length <= chunk):
            return fallback(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        # Scores and their exp in float32 whatever the weights' dtype, as MLX's own kernels accumulate.
        q, k, v = (a.astype(mx.float32) for a in (queries, keys, values))
        return causal_attention(q, k, v, scale, chunk).astype(queries.dtype)

    return attention


def use_chunked_attention(model: nn.Module, chunk: int) -> bool:
    """Route `model`'s full causal rows through `causal_attention` (chunk 0: back to mlx-lm's own).

    Rows it does not take (decoding with a cache, masks of arrays, sinks) go to
    the original. Returns whether the module had that function to replace.
    """
    return rebind(model, "scaled_dot_product_attention", lambda original: chunked_attention_function(original, chunk),
                   restore=chunk <= 0)


def use_vector_swiglu(model: nn.Module, enabled: bool) -> bool:
    """`model`'s SiLU gate through `vector_exp.sigmoid` (the native kernel or NumPy's exp, where MLX runs on the CPU),
    or back to mlx-lm's compiled `swiglu`. Models without a `swiglu` (gemma3's GELU) are left alone: returns False."""
    def vector_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
        def swiglu(gate: mx.array, x: mx.array) -> mx.array:  # a function of its own, to carry its original
            return vector_exp.swiglu(gate, x) if vector_exp.fast_active() else original(gate, x)
        return swiglu

    return rebind(model, "swiglu", vector_swiglu, restore=not enabled)


CPU_ATTENTION_CHUNK = 128  # queries a chunk, where MLX runs on the CPU (bench/RESULTS.md: 64, 128 and 256 measured)


def attention_chunk(setting: Optional[int]) -> int:
    """`train.attention_chunk_tokens` resolved: None is CPU_ATTENTION_CHUNK on the CPU backend, and 0 (mlx-lm's fused
    kernel) on a GPU."""
    if setting is not None:
        return setting
    return CPU_ATTENTION_CHUNK if mx.default_device().type == mx.DeviceType.cpu else 0


def use_fast_functions(model: nn.Module, attention_chunk_setting: Optional[int], *, native_exp: bool,
                       numpy_exp: bool) -> None:
    """The learner's choices for `model`: chunked attention (`attention_chunk`), and `vector_exp`'s native kernel,
    NumPy's exp in the forwards without a gradient, or MLX's exp everywhere."""
    vector_exp.use_native(native_exp)
    vector_exp.use_numpy(numpy_exp)
    use_chunked_attention(model, attention_chunk(attention_chunk_setting))
    use_vector_swiglu(model, native_exp or numpy_exp)
