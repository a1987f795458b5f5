"""Actor generation: EOS kept, logprobs agree with the learner's convention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import build_train_batch
from grpo_fleet.learner.step.objective import policy_logprobs
from grpo_fleet.models.generation import (
    SHARED_PREFIX_MIN_TOKENS,
    SamplingSettings,
    completion_text,
    encode_prompt,
    generate_groups,
)
from grpo_fleet.models.loading import load_policy


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir))


def _settings(policy, temperature: float, group_size: int = 6, max_tokens: int = 6) -> SamplingSettings:
    return SamplingSettings(
        group_size=group_size, max_tokens=max_tokens, temperature=temperature,
        stop_token_ids=sorted(policy.tokenizer.eos_token_ids),
    )


def _max_logprob_gap(policy, prompts, groups, temperature: float) -> float:
    """Largest |actor logprob - learner logprob| over every sampled token."""
    accepted = [
        AcceptedGroup(
            group_id=f"g{i}", prompt_index=i, prompt_tokens=np.asarray(prompt, dtype=np.int32),
            completions=[CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32), float(j),
                                          c.finish_reason)
                         for j, c in enumerate(group)],
            policy_version=0, actor_id="test",
        )
        for i, (prompt, group) in enumerate(zip(prompts, groups))
    ]
    batch = build_train_batch(accepted)
    learner_side = policy_logprobs(policy.model, batch.inputs, batch.targets, temperature)
    assert float(batch.mask.sum()) == sum(len(c.tokens) for g in groups for c in g)
    return float(mx.max(mx.abs(learner_side - batch.old_logprobs) * batch.mask))


# min_shared_prefix: 1 shares every prompt's prefill, None prefills G copies of each.
@pytest.mark.parametrize("min_shared_prefix", [1, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_actor_logprobs_match_learner_within_1e4(policy, temperature, min_shared_prefix):
    mx.random.seed(3)
    prompts = [encode_prompt(policy.tokenizer, text, chat_template=False) for text in ("123=", "9=", "4567=")]
    groups = generate_groups(policy.model, prompts, _settings(policy, temperature), min_shared_prefix=min_shared_prefix)
    assert _max_logprob_gap(policy, prompts, groups, temperature) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_long_shared_prefix_logprobs_match_learner_within_1e4(policy, temperature):
    # ~300-token prompts cross the KV cache's 256-slot growth step; different
    # lengths exercise padding, a repeated prompt deduplication, and the short
    # last prompt (below SHARED_PREFIX_MIN_TOKENS) takes the G-copies path in
    # the same batch.
    mx.random.seed(5)
    head = "0123456789" * 30
    texts = (head + "12=", head + "4=", head + "98765=", head + "12=", "7=")
    prompts = [encode_prompt(policy.tokenizer, text, chat_template=False) for text in texts]
    assert min(len(p) for p in prompts[:4]) > 256 and len(prompts[4]) < SHARED_PREFIX_MIN_TOKENS
    groups = generate_groups(policy.model, prompts, _settings(policy, temperature, group_size=4, max_tokens=8))
    assert [len(g) for g in groups] == [4] * len(prompts)
    assert _max_logprob_gap(policy, prompts, groups, temperature) < 1e-4


def test_group_completions_are_sampled_independently(policy):
    # Without stop tokens every completion runs 12 tokens over a near-uniform
    # policy: completions that shared one prefilled cache must still all differ.
    mx.random.seed(11)
    prompt = encode_prompt(policy.tokenizer, "0123456789" * 10 + "5=", chat_template=False)
    assert len(prompt) >= SHARED_PREFIX_MIN_TOKENS
    settings = SamplingSettings(group_size=8, max_tokens=12, temperature=1.0)
    groups = generate_groups(policy.model, [prompt, prompt], settings)
    for group in groups:
        assert len({tuple(c.tokens) for c in group}) == len(group)
        assert len({c.tokens[0] for c in group}) > 1
    assert {tuple(c.tokens) for c in groups[0]}.isdisjoint(tuple(c.tokens) for c in groups[1])


def test_groups_have_g_completions_and_keep_eos(policy):
    mx.random.seed(0)
    eos = set(policy.tokenizer.eos_token_ids)
    prompts = [encode_prompt(policy.tokenizer, "12=", chat_template=False)] * 4
    groups = generate_groups(policy.model, prompts, _settings(policy, 1.0, group_size=16, max_tokens=12))
    assert len(groups) == 4 and all(len(g) == 16 for g in groups)
    completions = [c for g in groups for c in g]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped, "a near-uniform policy over a small vocabulary must emit EOS within 12 tokens"
    for c in stopped:
        assert c.tokens[-1] in eos and len(c.logprobs) == len(c.tokens)
        assert completion_text(policy.tokenizer, c, eos) == policy.tokenizer.decode(c.tokens[:-1])
    for c in completions:
        assert c.finish_reason == "stop" or len(c.tokens) == 12
        assert all(lp <= 0 for lp in c.logprobs)


def test_greedy_generation_is_deterministic(policy):
    prompts = [encode_prompt(policy.tokenizer, "321=", chat_template=False)]
    settings = _settings(policy, 0.0, group_size=1)
    first = generate_groups(policy.model, prompts, settings)[0][0]
    second = generate_groups(policy.model, prompts, settings)[0][0]
    assert first.tokens == second.tokens


def test_chat_template_wraps_prompt(tiny_chat_model_dir):
    chat = load_policy(str(tiny_chat_model_dir))
    plain = encode_prompt(chat.tokenizer, "How many?", chat_template=False)
    wrapped = encode_prompt(chat.tokenizer, "How many?", chat_template=True, system_prompt="Think first.")
    text = chat.tokenizer.decode(wrapped)
    assert len(wrapped) > len(plain)
    assert "Think first." in text and text.rstrip().endswith("assistant")


@pytest.fixture(scope="module")
def peaky_bf16_policy(tiny_model_dir):
    """The tiny model in bf16 with logits as peaky as a real LM's (largest around 18).

    mlx-lm normalises in the model's dtype; in bf16 that alone put actor and
    learner up to 0.1 nats apart on such logits.
    """
    policy = load_policy(str(tiny_model_dir), dtype="bfloat16")
    norm = policy.model.model.norm  # the final RMSNorm's gain scales the logits and nothing else
    prompt = mx.array([encode_prompt(policy.tokenizer, "123=", chat_template=False)])
    peak = float(mx.max(mx.abs(policy.model(prompt).astype(mx.float32))))
    norm.weight = (norm.weight.astype(mx.float32) * (18.0 / peak)).astype(mx.bfloat16)
    mx.eval(policy.model.parameters())
    return policy


@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_bf16_actor_logprobs_are_float32_and_match_learner(peaky_bf16_policy, temperature):
    policy = peaky_bf16_policy
    assert policy.model.model.embed_tokens.weight.dtype == mx.bfloat16
    mx.random.seed(7)
    prompts = [encode_prompt(policy.tokenizer, text, chat_template=False) for text in ("123=", "9=", "4567=")]
    peak = float(mx.max(mx.abs(policy.model(mx.array([prompts[0]])).astype(mx.float32))))
    assert 12 < peak < 30, f"logits not peaky enough to show the bf16 gap: {peak}"
    groups = generate_groups(policy.model, prompts, _settings(policy, temperature, group_size=8, max_tokens=8))
    assert _max_logprob_gap(policy, prompts, groups, temperature) < 1e-4


def test_truncated_sampling_is_refused(policy):
    from grpo_fleet.config import GenerationConfig
    from grpo_fleet.models.generation import TruncatedSamplingError

    settings = SamplingSettings(group_size=2, max_tokens=2, top_p=0.9)
    with pytest.raises(TruncatedSamplingError, match="top_p"):
        generate_groups(policy.model, [[3, 4]], settings)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0.95)
