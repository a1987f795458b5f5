"""export/llamacpp_check.py's mlx-lm side: one forward pass over a continuation says how far mlx-lm's greedy
decoding reproduces it, as mlx-lm's own token-by-token generation does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from gguf_synth import tiny_args, tiny_model
from grpo_fleet.export.llamacpp_check import mlx_reproduces

VOCAB = 300
TOKENS = 12


def _generated(model: object, prompt: list[int]) -> list[int]:
    """mlx-lm's greedy decoding, a token at a time through its KV cache."""
    steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS, sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(token) for token, _ in steps]


def test_one_forward_pass_finds_where_greedy_decoding_parts_from_a_continuation() -> None:
    model = tiny_model(tiny_args("llama", VOCAB))
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, VOCAB, size=9).tolist()
        greedy = _generated(model, prompt)
        assert mlx_reproduces(model, prompt, greedy) == TOKENS
        for at in (0, 5, TOKENS - 1):  # a continuation that parts from greedy decoding at `at`
            other = [*greedy[:at], (greedy[at] + 1) % VOCAB, *greedy[at + 1:]]
            assert mlx_reproduces(model, prompt, other) == at
    assert mlx_reproduces(model, prompt, []) == 0


def test_another_models_continuation_is_not_reproduced() -> None:
    model, other = tiny_model(tiny_args("llama", VOCAB), seed=0), tiny_model(tiny_args("llama", VOCAB), seed=1)
    prompt = list(range(10, 19))
    theirs = _generated(other, prompt)
    assert _generated(model, prompt) != theirs
    shared = mlx_reproduces(model, prompt, theirs)
    assert shared < TOKENS and _generated(model, prompt)[:shared] == theirs[:shared]
    assert _generated(model, prompt)[shared] != theirs[shared]
