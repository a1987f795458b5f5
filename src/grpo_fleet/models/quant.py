"""Quantized models on each backend: Metal runs them 4-bit, the CPU backend dequantises them.

MLX's CPU quantized matmul is not vectorised: measured here at ~2 GF/s whatever
the batch with fp32 scales and activations (~0.2 GF/s with bf16 ones), against
40-80 GF/s for fp32 through OpenBLAS at 16-128 tokens. A 2-layer Qwen2.5-0.5B-shape
forward of 128 tokens took 23 s 4-bit (fp32 scales), 0.7-0.9 s in float. Loading
a quantized model on the CPU therefore swaps its quantized layers for float ones
holding exactly the dequantised values (same logits up to rounding) and pays the
memory. The files on disk, and so the model digest, stay as they are.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_reduce

log = logging.getLogger("grpo_fleet.models.loading")


def cast_floating(model: nn.Module, dtype_name: str) -> None:
    """Cast floating-point weights (quantized integer weights stay as they are)."""
    dtype = getattr(mx, dtype_name)
    model.set_dtype(dtype, predicate=lambda current: mx.issubdtype(current, mx.floating))


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer holds packed integer weights."""
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, packed weights, scales and biases included."""
    return int(tree_reduce(lambda total, leaf: total + leaf.nbytes, model.parameters(), 0))


def prepare_weights(model: nn.Module, path: str, dtype: Optional[str], dequantize: bool) -> None:
    """Dequantise (if asked and quantized), then cast floating weights to `dtype`; log what it cost."""
    if not (dequantize and is_quantized(model)):
        if dtype:
            cast_floating(model, dtype)
        return
    before = weight_bytes(model)
    if dtype:
        # Scales and biases first, so the weights are dequantised in `dtype` exactly as the
        # quantized kernel would compute them, not rounded through bf16 scales (0.4% off).
        cast_floating(model, dtype)
    dequantize_for_cpu(model)
    mx.eval(model.parameters())
    log.info(
        "%s is quantized: dequantised to %s for compute on the %s backend (there a 4-bit forward is "
        "~30x slower than a float one, ~300x with bf16 scales); weights %.0f MB -> %.0f MB",
        path, dtype or "the scales' dtype", mx.default_device(), before / 1e6, weight_bytes(model) / 1e6,
    )


def dequantize_for_cpu(model: nn.Module) -> None:
    """Replace QuantizedLinear/QuantizedEmbedding with float layers holding exactly the values the
    quantized matmul would use, so logits match the 4-bit model up to float rounding.

    Metal keeps 4-bit: there it is the fast path (and the memory saving).
    """
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    # A tied head keeps working: nn.Embedding.as_linear replaces QuantizedEmbedding.as_linear.
