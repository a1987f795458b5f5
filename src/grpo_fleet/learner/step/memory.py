"""How much memory one learner step needs, and whether this machine has it.

A plain estimate from the model's shape and the run's memory settings, checked
at start-up: a configuration that cannot fit is refused with the setting to
lower, instead of the kernel killing the learner mid-step with nothing in its
log. The constants were measured with `mx.get_peak_memory` (see
tests/unit/test_memory.py, which keeps the estimate an upper bound).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.step.attention import attention_chunk
from grpo_fleet.runtime.trees import flat_leaves

GIB = float(1 << 30)
# Activations kept for the backward pass, per token and transformer block, in
# units of the model's element size: attention and MLP inputs and outputs
# (about 16 hidden-wide vectors) plus the MLP's gate, up and activation (about
# 4 intermediate-wide ones). At Qwen2.5-0.5B's widths in fp32 that is 132 KiB.
HIDDEN_VECTORS_PER_TOKEN, INTERMEDIATE_VECTORS_PER_TOKEN = 16, 4
# Per token outside the blocks (embedding output, final norm, the gathered
# completion states and their gradients): about 32 hidden-wide vectors.
HIDDEN_VECTORS_OUTSIDE_BLOCKS = 32
# With grad checkpointing a block's input is kept (2 vectors with its gradient),
# and recomputing a block holds about three blocks' worth while it runs.
CHECKPOINTED_BLOCK_VECTORS, RECOMPUTED_BLOCKS = 2, 3
# Attention on the CPU path (mx.fast's fallback and its gradient) holds [rows, heads, W, W] scores and
# probabilities in each block the backward pass goes through: per token, about two heads x W values (2.1 measured,
# tests/unit/test_memory.py). So a micro-batch of a fixed token budget grows linearly with its width W, not
# quadratically, and by W ~ 500 attention holds as much as the rest of a SmolLM2 block.
ATTENTION_BUFFERS = 2
# The width a step is planned for when the caller does not know its prompts: max_tokens plus a long prompt.
PROMPT_TOKENS_ALLOWANCE = 256
# Measured peaks ran up to 10% over the sum above; plan with a margin.
ACTIVATION_MARGIN = 1.25
# fp32 [chunk, vocab] buffers alive in the LM head's backward: about 3 under
# train.memory_limit_gb (MLX then runs the chunks one at a time), and up to about
# 8 without, when MLX runs several chunks side by side. (A default limit is not
# set: at the demo's shape one slowed the step by 35%.)
LOGIT_BUFFERS_LIMITED, LOGIT_BUFFERS_UNLIMITED = 3, 8
# Share of the machine's memory a step may plan to use: the OS, the actor on
# the same Mac, and MLX's cache need the rest.
USABLE_SHARE = 0.85


class MemoryBudgetError(RuntimeError):
    """The configured learner step cannot fit this machine's memory."""


@dataclass(frozen=True)
class StepMemory:
    """Estimated peak bytes of one learner step, by what holds them."""

    weights: int  # every parameter, resident
    optimizer: int  # gradients plus AdamW's two moments, for the trainable ones
    activations: int  # what the backward pass of the largest micro-batch keeps
    logits: int  # one LM-head chunk's fp32 [chunk, vocab] buffers

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.activations + self.logits

    def describe(self) -> str:
        parts = (("weights", self.weights), ("gradients + optimizer", self.optimizer),
                 ("activations", self.activations), ("logits", self.logits))
        return f"{self.total / GIB:.2f} GiB (" + ", ".join(f"{name} {size / GIB:.2f}" for name, size in parts) + ")"


def _shape(model: nn.Module) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, layers, vocab, heads) from an mlx-lm model's args."""
    args: Any = getattr(model, "args", None)
    hidden = int(getattr(args, "hidden_size", 0))
    intermediate = int(getattr(args, "intermediate_size", 4 * hidden))
    layers = int(getattr(args, "num_hidden_layers", len(getattr(model, "layers", []))))
    vocab = int(getattr(args, "vocab_size", 0))
    heads = int(getattr(args, "num_attention_heads", 0) or max(1, hidden // 64))
    return hidden, intermediate, layers, vocab, heads


def _nbytes(params: Any) -> int:
    return sum(value.nbytes for _, value in flat_leaves(params) if isinstance(value, mx.array))


def planned_width(cfg: RunConfig) -> int:
    """The widest row a step is planned for: the longest completion (or episode) after a long prompt."""
    longest = cfg.task.max_episode_tokens if cfg.task.env else cfg.generation.max_tokens
    return longest + PROMPT_TOKENS_ALLOWANCE


def blocks_with_gradients(cfg: RunConfig, layers: int) -> int:
    """Blocks the backward pass goes through: LoRA's last lora.num_layers, else every one. The frozen blocks
    below run forward only and keep nothing for it."""
    if cfg.lora.enabled and 0 <= cfg.lora.num_layers < layers:
        return cfg.lora.num_layers
    return layers


def estimate_step_memory(model: nn.Module, cfg: RunConfig, *, reference_copy: bool = False,
                         width: Optional[int] = None) -> StepMemory:
    """Peak bytes of `Trainer.step` for this model under `cfg.train`'s micro-batch and chunk sizes.

    `reference_copy`: pi_ref is a second, frozen copy of the weights (full fine-tuning with beta > 0).
    `width`: the longest row (prompt + completion) a micro-batch holds; `planned_width` by default.
    """
    hidden, intermediate, layers, vocab, heads = _shape(model)
    element = max((v.dtype.size for _, v in flat_leaves(model.parameters()) if isinstance(v, mx.array)), default=4)
    width = planned_width(cfg) if width is None else width
    chunk_queries = attention_chunk(cfg.train.attention_chunk_tokens)
    # Chunked attention holds one chunk's scores at a time: a row's keys against `chunk_queries` queries, not all.
    attention = element * ATTENTION_BUFFERS * heads * (min(width, chunk_queries) if chunk_queries else width)
    per_block = element * (HIDDEN_VECTORS_PER_TOKEN * hidden + INTERMEDIATE_VECTORS_PER_TOKEN * intermediate) + attention
    outside = element * HIDDEN_VECTORS_OUTSIDE_BLOCKS * hidden
    tokens = max(cfg.train.micro_batch_tokens, width)  # a row wider than the budget is a micro-batch of its own
    graded = blocks_with_gradients(cfg, layers)
    if cfg.train.grad_checkpoint:
        per_token = graded * CHECKPOINTED_BLOCK_VECTORS * hidden * element + RECOMPUTED_BLOCKS * per_block + outside
    else:
        per_token = (graded + (graded < layers)) * per_block + outside  # a frozen block's forward, while it runs
    activations = int(ACTIVATION_MARGIN * tokens * per_token)
    chunk = min(cfg.train.logprob_chunk_tokens, tokens)
    chunks = -(-tokens // chunk)
    buffers = LOGIT_BUFFERS_LIMITED if cfg.train.memory_limit_gb is not None else LOGIT_BUFFERS_UNLIMITED
    return StepMemory(
        weights=_nbytes(model.parameters()) * (2 if reference_copy else 1),
        optimizer=3 * _nbytes(model.trainable_parameters()),
        activations=activations,
        logits=min(buffers, 3 * chunks) * chunk * vocab * 4,
    )


def machine_memory_bytes() -> int:
    """Physical memory, or Metal's recommended working set where that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = mx.device_info()
    working_set = int(info.get("max_recommended_working_set_size", 0) or 0)
    return min(total, working_set) if working_set else total


def check_step_fits(estimate: StepMemory, available: int) -> None:
    """Refuse a step that cannot fit, naming the settings that shrink it."""
    usable = int(USABLE_SHARE * available)
    if estimate.total <= usable:
        return
    raise MemoryBudgetError(
        f"one learner step needs about {estimate.describe()}, but this machine has {available / GIB:.1f} GiB "
        f"({usable / GIB:.1f} GiB usable). Lower train.micro_batch_tokens (activations scale with it), "
        "set train.grad_checkpoint = true, lower train.logprob_chunk_tokens, or train LoRA adapters instead of "
        "every weight (lora.enabled = true)."
    )


def trim_cache(peak: int) -> None:
    """Free MLX's buffer cache when it outgrows this step's peak.

    Micro-batch shapes vary from step to step, so cached buffers of sizes never
    reused would otherwise pile up; bounding the cache by one step's peak keeps
    reuse within a step and stops the creep across steps.
    """
    if mx.get_cache_memory() > peak:
        mx.clear_cache()
