"""Actor generation: EOS kept, logprobs agree with the learner's convention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.actor.rollout import SamplingSettings, completion_text, encode_prompt, generate_groups
from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord, build_train_batch
from grpo_fleet.learner.trainer import policy_logprobs
from grpo_fleet.model import load_policy


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir))


def _settings(policy, temperature: float, group_size: int = 6, max_tokens: int = 6) -> SamplingSettings:
    return SamplingSettings(
        group_size=group_size, max_tokens=max_tokens, temperature=temperature,
        stop_token_ids=sorted(policy.tokenizer.eos_token_ids),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_actor_logprobs_match_learner_within_1e4(policy, temperature):
    mx.random.seed(3)
    prompts = [encode_prompt(policy.tokenizer, text, chat_template=False) for text in ("123=", "9=", "4567=")]
    groups = generate_groups(policy.model, prompts, _settings(policy, temperature))
    accepted = [
        AcceptedGroup(
            group_id=f"g{i}", prompt_index=i, prompt_tokens=np.asarray(prompt, dtype=np.int32),
            completions=[CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32), float(j), c.finish_reason)
                         for j, c in enumerate(group)],
            policy_version=0, actor_id="test",
        )
        for i, (prompt, group) in enumerate(zip(prompts, groups))
    ]
    batch = build_train_batch(accepted)
    learner_side = policy_logprobs(policy.model, batch.inputs, batch.targets, temperature)
    gap = mx.abs(learner_side - batch.old_logprobs) * batch.mask
    assert float(mx.max(gap)) < 1e-4
    assert float(batch.mask.sum()) == sum(len(c.tokens) for g in groups for c in g)


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
