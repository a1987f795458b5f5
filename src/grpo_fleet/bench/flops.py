"""How many floating-point operations one learner step needs: the model's shape times the batch's real tokens.

Counted per real position (a row's prompt and completion positions, up to its
last completion target), from the block's own matmuls; nothing here runs the
model. Under LoRA the base weights are frozen, but the step still pays for them:

| pass | FLOPs |
|---|---|
| pi_ref forward (beta > 0) | 2 P a position; the LM head 2 V d at completion positions |
| the policy's forward | the same, plus the adapters: 2 r (in + out) a matrix |
| its backward | activation gradient 2 P through the adapted blocks; head 2 V d; adapters 4 r (in + out) |
| recomputed (not useful) | grad checkpointing: adapted blocks' forward; the chunked head's forward |

P is the matmul weights of a block (attention and MLP projections), so the
frozen body's weight gradient (another 2 P) is never computed and not counted.
Attention adds 2 a n (n + 1) a block per row of n positions in the forward
(QK^T and AV over the causal half; a = heads x head dim), twice that backward.
Padding is counted apart (`executed`): positions the model runs on that are
neither prompt nor completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from grpo_fleet.learner.step.batch import MicroBatch, row_lengths


@dataclass(frozen=True)
class ModelShape:
    """What a step's FLOPs depend on: one block's matmul weights, the head, and where the adapters are."""

    blocks: int
    block_params: int  # matmul weights of one block (attention and MLP projections)
    attention_width: int  # heads x head dim: the width of QK^T and AV
    head_params: int  # vocabulary x hidden: the LM head, run at completion positions only
    adapted_blocks: int  # blocks with LoRA adapters, counted from the top: backward runs through these
    adapter_params: int  # LoRA A and B of every adapted block together


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear, QuantizedLinear (32 / bits values per packed uint32) or LoRA-wrapped one."""
    linear: Any = getattr(module, "linear", module)
    out_dims, packed = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        return int(packed * 32 // linear.bits), int(out_dims)
    return int(packed), int(out_dims)


def head_dims(model: nn.Module) -> tuple[int, int]:
    """(hidden, vocabulary) of the LM head: `lm_head`, or the tied input embedding."""
    head = getattr(model, "lm_head", None) or model.model.embed_tokens
    vocab, packed = head.weight.shape
    quantized = isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    return (int(packed * 32 // head.bits) if quantized else int(packed)), int(vocab)


def model_shape(model: nn.Module) -> ModelShape:
    """The shape of an mlx-lm model (`model.layers`, and `lm_head` or a tied `model.embed_tokens`), LoRA or not."""
    layers = list(model.layers)
    matmuls = [m for _, m in layers[0].named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    block = sum(i * o for i, o in map(linear_dims, matmuls))
    adapted = [index for index, layer in enumerate(layers) if _adapter_params(layer)]
    hidden, vocab = head_dims(model)
    return ModelShape(blocks=len(layers), block_params=block, attention_width=linear_dims(layers[0].self_attn.q_proj)[1],
                      head_params=hidden * vocab, adapted_blocks=len(layers) - min(adapted) if adapted else 0,
                      adapter_params=sum(_adapter_params(layer) for layer in layers))


def _adapter_params(layer: nn.Module) -> int:
    flat: Any = tree_flatten(layer.parameters())
    return sum(int(v.size) for name, v in flat if name.endswith(("lora_a", "lora_b")))


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs: what the update needs (`useful`), and what runs besides (`recomputed`, `padding`)."""

    useful: float
    recomputed: float
    padding: float  # the body's forward passes over padded positions
    real_positions: int
    padded_positions: int  # rows x width over the micro-batches, as the model runs them
    unrounded_positions: int  # the same with each micro-batch as wide as its longest row (no length bucket)

    @property
    def executed(self) -> float:
        return self.useful + self.recomputed + self.padding


def _attention(shape: ModelShape, lengths: np.ndarray) -> float:
    """QK^T and AV of one block's forward over rows of `lengths` positions, causal half only."""
    return float(2 * shape.attention_width * np.sum(lengths.astype(np.float64) * (lengths + 1)))


def _passes(shape: ModelShape, mask: np.ndarray) -> tuple[float, float, float, int]:
    """(one block's forward, the head's forward, the adapters' forward, real positions) over the batch."""
    lengths = row_lengths(mask)
    positions, completions = int(lengths.sum()), int((mask != 0).sum())
    body = 2.0 * shape.block_params * positions + _attention(shape, lengths)
    return body, 2.0 * shape.head_params * completions, 2.0 * shape.adapter_params * positions, positions


def forward_flops(shape: ModelShape, mask: np.ndarray) -> float:
    """One plain forward of the base (pi_ref's: adapters off) at the batch's real positions."""
    body, head, _, _ = _passes(shape, mask)
    return shape.blocks * body + head


def step_flops(shape: ModelShape, mask: np.ndarray, micro: Sequence[MicroBatch], *, reference: bool,
               grad_checkpoint: bool) -> StepFlops:
    """FLOPs of one `Trainer.step` (one epoch) on the batch whose completion `mask` is `[N, L]`, split as `micro`."""
    lengths = row_lengths(mask)
    body, head, adapters, positions = _passes(shape, mask)
    forward = shape.blocks * body + head
    backward = shape.adapted_blocks * (body + _attention(shape, lengths)) + head + 2 * adapters
    useful = forward * (2 if reference else 1) + adapters + backward
    recomputed = head + (shape.adapted_blocks * body if grad_checkpoint else 0.0)
    padded = sum(int(m.inputs.shape[0] * m.inputs.shape[1]) for m in micro)
    unrounded = sum(len(m.rows) * int(lengths[m.rows].max()) for m in micro if m.rows is not None)
    passes = (2 if reference else 1) * shape.blocks + (shape.adapted_blocks if grad_checkpoint else 0)
    padding = passes * 2.0 * shape.block_params * (padded - positions)
    return StepFlops(useful, recomputed, padding, positions, padded, unrounded)
