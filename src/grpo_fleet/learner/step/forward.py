"""The policy's forward at completion positions only: the body once, then the LM head in chunks.

A plain `model(inputs)` materialises `[n, W, V]` fp32 logits (prompt and padding
included), which at a 151,936-token vocabulary is what runs the learner out of
memory. Here the transformer body runs once, its hidden states are gathered at
the completion positions, and the head + logsumexp + gather run chunk by chunk,
recomputed in the backward pass as `mx.checkpoint` would (`logprobs.chunked_logprobs`).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.learner.step import vector_exp
from grpo_fleet.learner.step.batch import MicroBatch
from grpo_fleet.learner.step.logprobs import chunked_logprobs

Project = Callable[[Any, mx.array], mx.array]


def lm_head(model: nn.Module) -> tuple[nn.Module, Callable[[nn.Module, mx.array], mx.array]]:
    """The module holding the LM head and how to apply it, for mlx-lm's `head(model.model(x))` models.

    Untied models have `lm_head`; tied ones (qwen2 0.5B, the tiny model) project
    with the input embedding, `embed_tokens.as_linear`.
    """
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head, lambda module, h: module(h)
    body = getattr(model, "model", None)
    embed = getattr(body, "embed_tokens", None)
    if embed is None or not hasattr(embed, "as_linear"):
        raise ValueError(f"{type(model).__name__}: no lm_head and no tied embed_tokens; cannot split body and head")
    return embed, lambda module, h: module.as_linear(h)


def _projection(model: nn.Module) -> tuple[Project, Any]:
    """`project(params, h)` over the head's trainable weights, in mlx-lm's grad_checkpoint style.

    The weights go in as an argument (and are set on the module inside) because
    the chunked head's custom gradient is taken only with respect to its
    arguments; a frozen head passes none and is read as a constant.
    """
    module, apply = lm_head(model)

    def project(params: Any, h: mx.array) -> mx.array:
        module.update(params)
        return apply(module, h)

    return project, module.trainable_parameters()


def completion_logprobs(model: nn.Module, micro: MicroBatch, *, temperature: float, chunk_tokens: int) -> mx.array:
    """Logprobs `[n, T]` of each completion token under log_softmax(logits / T), fp32.

    Slots past a completion's end (mask 0) hold an arbitrary real logprob; the
    loss masks them.
    """
    hidden = model.model(micro.inputs)
    rows, width, dim = hidden.shape
    picked = mx.take(hidden.reshape(rows * width, dim), micro.positions, axis=0)
    project, params = _projection(model)
    flat = chunked_logprobs(picked, micro.targets, project, params, temperature=temperature, chunk_size=chunk_tokens)
    return mx.take(flat, micro.layout)


def frozen_logprobs(model: nn.Module, micro_batches: list[MicroBatch], *, temperature: float,
                    chunk_tokens: int) -> list[mx.array]:
    """Stop-gradient `completion_logprobs` per micro-batch, evaluated one at a time (so memory stays one micro-batch's).

    No gradient is traced here, so the exponentials may go through NumPy (`vector_exp.numpy_scope`).
    """
    out: list[mx.array] = []
    with vector_exp.numpy_scope():
        for micro in micro_batches:
            logprobs = mx.stop_gradient(completion_logprobs(model, micro, temperature=temperature,
                                                            chunk_tokens=chunk_tokens))
            mx.eval(logprobs)
            out.append(logprobs)
    return out


def enable_grad_checkpoint(model: nn.Module) -> None:
    """Recompute every transformer block in the backward pass, with mlx-lm's `grad_checkpoint`.

    mlx-lm patches the block's class, so every instance of it in this process is
    checkpointed (harmless without a gradient); the marker keeps a second Trainer
    from wrapping it twice.
    """
    from mlx_lm.tuner.trainer import grad_checkpoint

    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} exposes no `layers` to checkpoint")
    block_class = type(layers[0])
    if not getattr(block_class, "_grpo_fleet_checkpointed", False):
        grad_checkpoint(layers[0])
        block_class._grpo_fleet_checkpointed = True
