"""The step's FLOP count (bench/flops.py) against the formulas worked out by hand for a small llama."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models import llama

from grpo_fleet.bench.flops import forward_flops, model_shape, step_flops
from grpo_fleet.config import LoraConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import LENGTH_BUCKET, build_train_batch, split_batch
from grpo_fleet.models.loading import apply_lora

HIDDEN, MLP, HEADS, KV_HEADS, VOCAB, BLOCKS = 64, 128, 4, 2, 300, 3


def small_llama(adapted_blocks: int) -> llama.Model:
    args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=BLOCKS, intermediate_size=MLP,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                           vocab_size=VOCAB, tie_word_embeddings=True)
    model = llama.Model(args)
    if adapted_blocks:
        apply_lora(model, LoraConfig(enabled=True, rank=4, num_layers=adapted_blocks))
    return model


def one_group(prompt: int, completions: list[int]) -> AcceptedGroup:
    records = [CompletionRecord(np.ones(n, np.int32), np.zeros(n, np.float32), float(i), "stop")
               for i, n in enumerate(completions)]
    return AcceptedGroup("g", 0, np.ones(prompt, np.int32), records, 0, "a")


def test_the_shape_counts_every_matmul_of_a_block_and_the_adapters_where_they_are():
    shape = model_shape(small_llama(adapted_blocks=2))
    kv = HIDDEN // HEADS * KV_HEADS
    assert shape.block_params == HIDDEN * HIDDEN * 2 + HIDDEN * kv * 2 + HIDDEN * MLP * 3
    assert shape.attention_width == HIDDEN
    assert shape.head_params == HIDDEN * VOCAB
    assert shape.adapted_blocks == 2
    # mlx-lm's default keys: every linear of the block gets r x (in + out).
    per_block = sum(4 * (i + o) for i, o in [(HIDDEN, HIDDEN)] * 2 + [(HIDDEN, kv)] * 2 + [(HIDDEN, MLP)] * 2
                    + [(MLP, HIDDEN)])
    assert shape.adapter_params == 2 * per_block
    assert model_shape(small_llama(adapted_blocks=0)).adapted_blocks == 0


def test_a_lora_step_counts_the_frozen_base_forward_twice_and_its_activation_gradient_once():
    shape = model_shape(small_llama(adapted_blocks=2))
    # Two rows: prompt 5 + completion 7, prompt 5 + completion 2 (each row's positions: up to its last target).
    batch = build_train_batch([one_group(5, [7, 2])])
    mask = np.array(batch.mask)
    micro = split_batch(batch, 10_000)
    counted = step_flops(shape, mask, micro, reference=True, grad_checkpoint=False)
    lengths = np.array([4 + 7, 4 + 2])
    completions = 9
    attention = 2 * shape.attention_width * float(np.sum(lengths * (lengths + 1)))
    body = 2 * shape.block_params * lengths.sum() + attention
    head = 2 * shape.head_params * completions
    adapters = 2 * shape.adapter_params * lengths.sum()
    forward = BLOCKS * body + head
    backward = 2 * (body + attention) + head + 2 * adapters
    assert counted.useful == pytest.approx(2 * forward + adapters + backward)
    assert forward_flops(shape, mask) == pytest.approx(forward)
    assert counted.real_positions == lengths.sum()
    assert counted.padded_positions == 2 * LENGTH_BUCKET  # one micro-batch, both rows at the longest's width
    assert counted.unrounded_positions == 2 * lengths.max()  # ... and at its real length, before the bucket
    assert counted.padding == pytest.approx(2 * BLOCKS * 2 * shape.block_params * (2 * LENGTH_BUCKET - lengths.sum()))
    assert counted.recomputed == pytest.approx(head)  # the chunked head's forward, again in the backward
    checkpointed = step_flops(shape, mask, micro, reference=False, grad_checkpoint=True)
    assert checkpointed.useful == pytest.approx(forward + adapters + backward)
    assert checkpointed.recomputed == pytest.approx(head + 2 * body)


def test_the_padding_figure_plans_completions_spread_16_to_512_within_5_percent():
    from grpo_fleet.bench import Report
    from grpo_fleet.bench.step_flops import SPREAD, spread_groups, spread_padding

    groups = spread_groups(8, 8, SPREAD, 1000, seed=1)
    lengths = [len(c.tokens) for g in groups for c in g.completions]
    assert min(lengths) >= SPREAD[0] and max(lengths) <= SPREAD[1] and max(lengths) - min(lengths) > 300
    report = Report()
    spread_padding(report)
    (figure,) = report.figures
    assert figure.unit == "x" and 1.0 < figure.value <= 1.05, figure
