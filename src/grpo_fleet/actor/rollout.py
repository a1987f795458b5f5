"""Batched generation of G completions per prompt, with the logprob of every sampled token.

Uses mlx-lm's `BatchGenerator` directly because `batch_generate` drops the EOS
token and its logprob, and the learner needs both to score the stop decision.

Logprob convention (shared with the learner): log_softmax(logits / temperature)
at the sampled token, under the snapshot that generated it (pi_old). Temperature
is applied as a logits processor, so the distribution that is sampled from is the
one whose logprobs are recorded. top_p only truncates sampling; the recorded
logprob is still that of the tempered, untruncated distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn


@dataclass
class GeneratedCompletion:
    """One sampled completion: token ids (EOS included when it stopped) and their logprobs."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    reward: float = 0.0


@dataclass
class SamplingSettings:
    """What the learner told the actor to sample with."""

    group_size: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)


def _sampler_and_processors(settings: SamplingSettings) -> tuple[Any, list]:
    from mlx_lm.sample_utils import make_sampler

    if settings.temperature == 0:
        return make_sampler(temp=0.0), []
    top_p = 0.0 if settings.top_p >= 1.0 else settings.top_p
    sampler = make_sampler(temp=1.0, top_p=top_p)
    if settings.temperature == 1.0:
        return sampler, []
    inverse = 1.0 / settings.temperature
    return sampler, [lambda _tokens, logits: logits * inverse]


def generate_groups(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    *,
    completion_batch_size: int = 64,
    on_step: Optional[Callable[[], None]] = None,
) -> list[list[GeneratedCompletion]]:
    """Sample `group_size` completions for each prompt in one continuous batch.

    Returns one list of completions per prompt, in prompt order. `on_step` is
    called between decoding steps (the worker uses it to keep heartbeating).
    """
    from mlx_lm.generate import BatchGenerator

    sampler, processors = _sampler_and_processors(settings)
    total = len(prompts) * settings.group_size
    generator = BatchGenerator(
        model,
        max_tokens=settings.max_tokens,
        stop_tokens=[[int(t)] for t in settings.stop_token_ids],
        sampler=sampler,
        logits_processors=processors,
        completion_batch_size=min(total, completion_batch_size),
        prefill_batch_size=min(total, completion_batch_size),
    )
    try:
        expanded = [list(map(int, p)) for p in prompts for _ in range(settings.group_size)]
        uids = generator.insert(expanded)
        finished = _drain(generator, uids, on_step)
    finally:
        generator.close()
    flat = [finished[uid] for uid in uids]
    size = settings.group_size
    return [flat[i : i + size] for i in range(0, len(flat), size)]


def _drain(generator: Any, uids: list[int], on_step: Optional[Callable[[], None]]) -> dict[int, GeneratedCompletion]:
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    logprobs: dict[int, list[mx.array]] = {uid: [] for uid in uids}
    finished: dict[int, GeneratedCompletion] = {}
    while len(finished) < len(uids):
        responses = generator.next_generated()
        if on_step is not None:
            on_step()
        if not responses:
            break
        for response in responses:
            tokens[response.uid].append(int(response.token))
            logprobs[response.uid].append(response.logprobs[response.token])
            if response.finish_reason is not None:
                values = mx.stack(logprobs[response.uid]).astype(mx.float32).tolist()
                finished[response.uid] = GeneratedCompletion(
                    tokens=tokens[response.uid], logprobs=values, finish_reason=response.finish_reason
                )
    missing = set(uids) - set(finished)
    if missing:
        raise RuntimeError(f"generation ended without finishing sequences {sorted(missing)[:5]}")
    return finished


def completion_text(tokenizer: Any, completion: GeneratedCompletion, eos_ids: set[int]) -> str:
    """Decode a completion for scoring, without its stop token."""
    tokens = completion.tokens
    if completion.finish_reason == "stop" and tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def encode_prompt(tokenizer: Any, text: str, *, chat_template: bool, system_prompt: str | None = None) -> list[int]:
    """Tokenize a prompt the way both learner and evaluator must: optionally through the chat template."""
    if not chat_template:
        return list(tokenizer.encode(text, add_special_tokens=False))
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))
