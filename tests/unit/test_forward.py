"""Tests for grpo_fleet.learner.step.forward: chunked logprobs at completion positions equal the dense computation."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import build_train_batch, split_batch
from grpo_fleet.learner.step.forward import completion_logprobs, enable_grad_checkpoint, lm_head
from grpo_fleet.learner.step.objective import policy_logprobs

VOCAB = 40


def llama(tied: bool, seed: int = 0) -> nn.Module:
    """A small llama built from mlx-lm's ModelArgs, with a tied or a separate LM head."""
    from mlx_lm.models import llama as llama_module

    args = llama_module.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=tied,
    )
    mx.random.seed(seed)
    model = llama_module.Model(args)
    mx.eval(model.parameters())
    return model


def groups(seed: int = 0) -> list[AcceptedGroup]:
    rng = np.random.default_rng(seed)
    made = []
    for g in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).astype(np.int32)
        records = [CompletionRecord(rng.integers(0, VOCAB, n).astype(np.int32), np.zeros(n, np.float32), float(i), "length")
                   for i, n in enumerate(rng.integers(1, 12, 3))]
        made.append(AcceptedGroup(f"g{g}", g, prompt, records, 0, "a"))
    return made


def assert_close(got: np.ndarray, want: np.ndarray, name: str, rel: float = 1e-5) -> None:
    """Relative to the tensor's norm: fp32 sums in another order differ elementwise near cancellations."""
    err = np.linalg.norm((got - want).astype(np.float64))
    assert err <= rel * np.linalg.norm(want.astype(np.float64)) + 1e-9, (name, err)


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_logprobs_and_gradients_equal_the_dense_computation(tied, chunk):
    model = llama(tied)
    batch = build_train_batch(groups())
    micro = split_batch(batch, 32)  # a few micro-batches
    temperature = 0.7
    weights = mx.random.normal(batch.mask.shape) * batch.mask  # a loss that weighs every completion token

    def dense(m):
        return mx.sum(policy_logprobs(m, batch.inputs, batch.targets, temperature) * weights)

    def chunked(m):
        total = mx.array(0.0)
        for part in micro:
            lp = completion_logprobs(m, part, temperature=temperature, chunk_tokens=chunk)
            rows = mx.array(np.broadcast_to(part.rows[:, None], part.columns.shape))
            total = total + mx.sum(lp * part.mask * weights[rows, mx.array(part.columns)])
        return total

    want, want_grads = nn.value_and_grad(model, dense)(model)
    got, got_grads = nn.value_and_grad(model, chunked)(model)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    want_flat, got_flat = dict(tree_flatten(want_grads)), dict(tree_flatten(got_grads))
    assert got_flat.keys() == want_flat.keys()
    assert ("lm_head.weight" in got_flat) == (not tied)
    for key, value in want_flat.items():
        assert_close(np.array(got_flat[key]), np.array(value), key)


def test_logprobs_are_taken_at_completion_positions_only():
    model = llama(tied=True)
    batch = build_train_batch(groups(1))
    dense = np.array(policy_logprobs(model, batch.inputs, batch.targets, 1.0))
    for part in split_batch(batch, 10_000):
        lp = np.array(completion_logprobs(model, part, temperature=1.0, chunk_tokens=4))
        on = np.array(part.mask) != 0
        rows = np.broadcast_to(part.rows[:, None], on.shape)
        np.testing.assert_allclose(lp[on], dense[rows[on], part.columns[on]], rtol=1e-5, atol=1e-6)
        # The head ran on K completion positions (bucketed), not on n x W.
        assert part.positions.shape[0] < part.padded_tokens


def test_lm_head_is_the_embedding_when_tied_and_lm_head_otherwise():
    tied, untied = llama(True), llama(False)
    assert lm_head(tied)[0] is tied.model.embed_tokens
    assert lm_head(untied)[0] is untied.lm_head


def test_grad_checkpoint_gives_the_same_gradients(restore_llama_blocks):
    batch = build_train_batch(groups(2))
    (part,) = split_batch(batch, 10_000)

    def loss(m):
        return mx.sum(completion_logprobs(m, part, temperature=1.0, chunk_tokens=8) * part.mask)

    plain_model = llama(True)
    _, plain = nn.value_and_grad(plain_model, loss)(plain_model)
    mx.eval(plain)
    unpatched = restore_llama_blocks.__call__
    model = llama(True)
    enable_grad_checkpoint(model)
    patched = restore_llama_blocks.__call__
    enable_grad_checkpoint(model)  # idempotent: the class is wrapped once
    assert patched is not unpatched and restore_llama_blocks.__call__ is patched
    _, checkpointed = nn.value_and_grad(model, loss)(model)
    for key, value in dict(tree_flatten(plain)).items():
        assert_close(np.array(dict(tree_flatten(checkpointed))[key]), np.array(value), key)
