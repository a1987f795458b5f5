"""Wire conversion for the actor: protocol messages to generation inputs, scored completions to `Rollouts` parts."""

from __future__ import annotations

from typing import Literal, Optional, Sequence, cast

import numpy as np

from grpo_fleet.models.generation import GeneratedCompletion, SamplingSettings
from grpo_fleet.protocol import messages as m


def sampling_settings(gen: m.GenerationParams, stop_token_ids: Sequence[int],
                      eval_sampling: Optional[m.EvalSampling] = None) -> SamplingSettings:
    """What the learner told us to sample with, stopping at the tokenizer's EOS ids; an eval lease says its own."""
    group_size, temperature = gen.group_size, gen.temperature
    if eval_sampling is not None:
        group_size, temperature = eval_sampling.samples, eval_sampling.temperature
    return SamplingSettings(
        group_size=group_size, max_tokens=gen.max_tokens, temperature=temperature,
        top_p=gen.top_p, stop_token_ids=sorted(stop_token_ids),
    )


def lease_prompts(lease: m.Lease) -> list[list[int]]:
    """The lease's prompts as token id lists, in lease order."""
    return [item.prompt_tokens.to_numpy().tolist() for item in lease.prompts]


def to_completion(completion: GeneratedCompletion, reward: float) -> m.Completion:
    """One completion in the dtypes the learner validates and trains in: int32 tokens, float32 logprobs
    (an episode's with its uint8 sampled/environment mask, turn starts and end)."""
    episode = completion.episode
    return m.Completion(
        tokens=m.Tensor.from_numpy(np.asarray(completion.tokens, dtype=np.int32)),
        logprobs=m.Tensor.from_numpy(np.asarray(completion.logprobs, dtype=np.float32)),
        reward=float(reward),
        finish_reason=cast(Literal["stop", "length"], completion.finish_reason),  # pydantic checks it
        mask=None if episode is None else m.Tensor.from_numpy(np.asarray(episode.mask, dtype=np.uint8)),
        turns=None if episode is None else list(episode.turns),
        end="" if episode is None else cast(m.EpisodeEnd, episode.end),
    )


def to_group(group_id: str, completions: Sequence[GeneratedCompletion], rewards: Sequence[float]) -> m.GroupResult:
    """A prompt's scored completions, as the group the learner dedups by `group_id`."""
    return m.GroupResult(group_id=group_id, completions=[to_completion(c, r) for c, r in zip(completions, rewards)])
