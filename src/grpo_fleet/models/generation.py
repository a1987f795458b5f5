"""Batched generation of G completions per prompt, with the logprob of every sampled token.

Uses mlx-lm's `BatchGenerator` directly because `batch_generate` drops the EOS
token and its logprob, and the learner needs both to score the stop decision.

Logprob convention (shared with the learner): log_softmax(logits / temperature)
in float32 at the sampled token, under the snapshot that generated it (pi_old),
whatever dtype the model computes in. mlx-lm normalises logits in the model's
dtype, which in bf16 is up to 0.1 nats off a float32 recomputation, so the model
is wrapped (`Float32Logits`) to hand the sampler float32 logits already divided
by the temperature: the distribution sampled from is the one whose logprobs are
recorded, with no per-row logits processors (an extra [B, V] pass per step).
top_p < 1 is refused: the nucleus is a different distribution from the one the
learner can recompute, so its ratios would be biased.

Shared prefix: the G completions of a prompt of at least SHARED_PREFIX_MIN_TOKENS
tokens start from one prefill of that prompt, instead of G prefills of copies that
compute the same KV state. Shorter prompts keep the G-copies prefill: there a
G-row prefill is memory-bound and costs about what one row does, while sharing
adds fixed work (copying caches into the batch). `grpo-fleet bench rollout`
measures both paths.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet import native
from grpo_fleet.models.native_functions import inverse_cdf_sampler

# Re-exported: callers that import it from here predate its neutral home.
from grpo_fleet.tasks.prompts import decode_completion
from grpo_fleet.tasks.prompts import encode_prompt as encode_prompt

# Measured on CPU, 4 prompts x G=8: with 4-8 token prompts sharing was ~2 ms per
# lease slower on the tiny demo model and even on a ~50M model; from 16 tokens
# it was even on the tiny model and faster on the ~50M one (1.0 s vs 1.8 s).
SHARED_PREFIX_MIN_TOKENS = 16
# Long prompts are prefilled this many tokens at a time, which bounds the
# activations a prefill holds (mlx-lm's default is 2048).
PREFILL_STEP_TOKENS = 512


@dataclass(frozen=True)
class EpisodeMarks:
    """What an episode's completion adds (envs/runner.py): 1 per sampled token and 0 per environment token,
    where each sampled turn starts, and why the episode ended ("done", "max_turns", "budget")."""

    mask: list[int]
    turns: list[int]
    end: str


@dataclass
class GeneratedCompletion:
    """One sampled completion: token ids (EOS included when it stopped) and their logprobs.

    An episode's completion holds every token after the prompt, the environment's
    too (logprob 0.0 there), and `episode` says which are which.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    episode: Optional[EpisodeMarks] = None


@dataclass
class SamplingSettings:
    """What the learner told the actor to sample with."""

    group_size: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)


class TruncatedSamplingError(ValueError):
    """top_p < 1: the recorded logprobs could not be those of the distribution sampled from."""


def refuse_truncated_sampling(top_p: float) -> None:
    if top_p < 1.0:
        raise TruncatedSamplingError(
            f"top_p={top_p} samples from the nucleus, a distribution the learner cannot recompute, so the "
            "importance ratios would be biased; set generation.top_p = 1.0 (lower the temperature to sharpen)"
        )


class Float32Logits:
    """A model whose logits come out in float32 and divided by the temperature.

    Casting before mlx-lm's normaliser makes the recorded logprobs the float32
    log_softmax(logits / T) the learner computes. Prefill never reads its
    logits, so under MLX's lazy evaluation the cast costs nothing there. Every
    other attribute (layers, make_cache, ...) is the wrapped model's.
    """

    def __init__(self, model: nn.Module, temperature: float) -> None:
        self._model = model
        self._temperature = temperature

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        logits = self._model(inputs, *args, **kwargs)
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        # Divide (not multiply by 1/T): the learner divides, and the two round differently.
        return logits if self._temperature in (0.0, 1.0) else logits / self._temperature

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def sampler_and_processors(settings: SamplingSettings) -> tuple[Any, list]:
    """The sampler and logits processors of `settings`, for mlx-lm's own generate (the benchmark's naive baseline)."""
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
    min_shared_prefix: Optional[int] = SHARED_PREFIX_MIN_TOKENS,
    prefill_step_size: int = PREFILL_STEP_TOKENS,
) -> list[list[GeneratedCompletion]]:
    """Sample `group_size` completions for each prompt in one continuous batch.

    Returns one list of completions per prompt, in prompt order. `on_step` is
    called between decoding steps (the worker uses it to keep heartbeating).
    Prompts with at least `min_shared_prefix` tokens are prefilled once for
    their whole group; None prefills G copies of every prompt.
    """
    size = settings.group_size
    batch_size = min(len(prompts) * size, completion_batch_size)
    generator = make_generator(model, settings, batch_size, prefill_step_size)
    try:
        rows = [list(map(int, p)) for p in prompts]
        shared = [] if min_shared_prefix is None else [r for r in rows if len(r) >= max(min_shared_prefix, 2)]
        with mx.stream(generator.stream):
            prefilled = _prefill_distinct(model, shared, batch_size, generator.prefill_step_size)
        uids = _insert_groups(generator, rows, size, prefilled)
        finished = _drain(generator, uids, on_step)
    finally:
        generator.close()
    flat = [finished[uid] for uid in uids]
    return [flat[i : i + size] for i in range(0, len(flat), size)]


def token_sampler(temperature: float) -> Callable[[mx.array], mx.array]:
    """The temperature is already in the logits (`Float32Logits`), so: greedy at T = 0, else a draw from the
    normalised logprobs: by their inverse CDF through the native exp where it runs, else mlx-lm's Gumbel-max."""
    from mlx_lm.sample_utils import make_sampler

    if temperature == 0:
        return cast(Callable[[mx.array], mx.array], make_sampler(temp=0.0))
    if native.active():
        return inverse_cdf_sampler
    return cast(Callable[[mx.array], mx.array], make_sampler(temp=1.0))


def make_generator(model: nn.Module, settings: SamplingSettings, batch_size: int, prefill_step_size: int) -> Any:
    """mlx-lm's BatchGenerator over float32 logits at `settings`' temperature (nucleus sampling refused)."""
    from mlx_lm.generate import BatchGenerator

    refuse_truncated_sampling(settings.top_p)
    return BatchGenerator(
        cast(nn.Module, Float32Logits(model, settings.temperature)),  # duck-typed: calls it, reads its layers
        max_tokens=settings.max_tokens,
        stop_tokens=[[int(t)] for t in settings.stop_token_ids],
        sampler=token_sampler(settings.temperature),
        completion_batch_size=batch_size,
        prefill_batch_size=batch_size,
        prefill_step_size=prefill_step_size,
    )


def _insert_groups(
    generator: Any, prompts: list[list[int]], group_size: int, prefilled: dict[tuple[int, ...], list],
    max_tokens: Optional[list[int]] = None,
) -> list[int]:
    """Queue G sequences per prompt, in prompt order; uids come back in the same order.

    A prompt whose prompt[:-1] was prefilled starts its G sequences from copies
    of that cache with only its last token left to feed; the generator always
    feeds a sequence's last prompt token as its first decode input, so the
    sampled logits come from the same computation as on the G-copies path.
    """
    inputs, caches, contexts = [], [], []
    for prompt in prompts:
        cache = prefilled.get(tuple(prompt[:-1]))
        for _ in range(group_size):
            inputs.append(prompt if cache is None else prompt[-1:])
            caches.append(None if cache is None else _clone_cache(cache))
            # The generator extends each sequence's token context in place: a list of its own each.
            contexts.append([] if cache is None else list(prompt[:-1]))
    limits = None if max_tokens is None else [limit for limit in max_tokens for _ in range(group_size)]
    return generator.insert(inputs, max_tokens=limits, caches=caches, all_tokens=contexts)


def _prefill_distinct(model: nn.Module, prompts: list[list[int]], batch_size: int, step: int) -> dict[tuple[int, ...], list]:
    """KV caches of every distinct prompt[:-1], prefilled once each (prompts of 2+ tokens).

    Uses mlx-lm's own `PromptProcessingBatch` (what `BatchGenerator` prefills
    with), so padding, chunking and the cache types supported are the same as
    on the G-copies path.
    """
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    prefixes = list(dict.fromkeys(tuple(p[:-1]) for p in prompts if len(p) > 1))
    caches: dict[tuple[int, ...], list] = {}
    for start in range(0, len(prefixes), batch_size):
        chunk = prefixes[start : start + batch_size]
        batch = PromptProcessingBatch(
            model, uids=list(range(len(chunk))), caches=[make_prompt_cache(model) for _ in chunk], prefill_step_size=step
        )
        batch.prompt([list(p) for p in chunk])
        caches.update({prefix: batch.extract_cache(i) for i, prefix in enumerate(chunk)})
    return caches


def _clone_cache(cache: list) -> list:
    """Per-sequence cache objects over the same prefilled arrays.

    Caches update themselves by slice assignment on their attributes, so two
    sequences must never hold the same cache object. Copying the array handles
    (not the data) is enough: an MLX slice assignment rebinds the handle it is
    made through and never writes into arrays other handles point to.
    """
    from mlx.utils import tree_map

    clones = []
    for layer in cache:
        clone = copy.copy(layer)
        clone.__dict__.update(tree_map(lambda x: copy.copy(x) if isinstance(x, mx.array) else x, vars(layer)))
        clones.append(clone)
    return clones


def _drain(generator: Any, uids: list[int], on_step: Optional[Callable[[], None]]) -> dict[int, GeneratedCompletion]:
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    logprobs: dict[int, list[float]] = {uid: [] for uid in uids}
    finished: dict[int, GeneratedCompletion] = {}
    while len(finished) < len(uids):
        responses = generator.next_generated()
        if on_step is not None:
            on_step()
        if not responses:
            break
        for response, value in zip(responses, _sampled_logprobs(responses)):
            tokens[response.uid].append(int(response.token))
            logprobs[response.uid].append(value)
            if response.finish_reason is not None:
                finished[response.uid] = GeneratedCompletion(
                    tokens=tokens[response.uid], logprobs=logprobs[response.uid], finish_reason=response.finish_reason
                )
    missing = set(uids) - set(finished)
    if missing:
        raise RuntimeError(f"generation ended without finishing sequences {sorted(missing)[:5]}")
    return finished


@dataclass
class TurnEnd:
    """A sequence's turn, ended: what it sampled, and the KV cache to go on from (every token through the last)."""

    key: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    cache: list
    context: list[int]  # the tokens that cache holds


class TurnGenerator:
    """Sequences that sample a turn, stop, and may go on later with tokens appended (an episode's observation).

    One continuous batch: a sequence that ends its turn leaves the batch with its
    KV cache, and one that resumes is prefilled with the appended tokens only, so
    a conversation is never prefilled (or tokenized) again. Keys are the caller's.
    """

    def __init__(self, model: nn.Module, settings: SamplingSettings, batch_size: int,
                 prefill_step_size: int = PREFILL_STEP_TOKENS) -> None:
        self.settings = settings
        self.generator = make_generator(model, settings, batch_size, prefill_step_size)
        self._model, self._batch_size = model, batch_size
        self._keys: dict[int, int] = {}  # uid -> key
        self._sampled: dict[int, tuple[list[int], list[float]]] = {}

    @property
    def active(self) -> bool:
        return bool(self._keys)

    def start(self, keys: Sequence[int], prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
              min_shared_prefix: Optional[int] = SHARED_PREFIX_MIN_TOKENS) -> None:
        """First turns; prompts with the same prefix of at least `min_shared_prefix` tokens are prefilled once."""
        rows = [list(map(int, p)) for p in prompts]
        shared = [] if min_shared_prefix is None else [r for r in rows if len(r) >= max(min_shared_prefix, 2)]
        with mx.stream(self.generator.stream):
            prefilled = _prefill_distinct(self._model, shared, self._batch_size, self.generator.prefill_step_size)
        uids = _insert_groups(self.generator, rows, 1, prefilled, list(max_tokens))
        self._track(keys, uids)

    def resume(self, end: TurnEnd, tokens: Sequence[int], max_tokens: int) -> None:
        """Go on from `end`'s cache with `tokens` appended (at least one), for at most `max_tokens` sampled."""
        uids = self.generator.insert([list(map(int, tokens))], max_tokens=[max_tokens], caches=[end.cache],
                                     all_tokens=[list(end.context)])
        self._track([end.key], uids)

    def cancel(self, keys: set[int]) -> None:
        """Stop these sequences wherever they are (their episode failed)."""
        uids = [uid for uid, key in self._keys.items() if key in keys]
        if uids:
            self.generator.remove(uids)
        for uid in uids:
            del self._keys[uid], self._sampled[uid]

    def next_ends(self, on_step: Optional[Callable[[], None]] = None, *, one_step: bool = False) -> list[TurnEnd]:
        """Decode until at least one sequence ends its turn (or for `one_step` only); every turn that ended in
        that step."""
        ends: list[TurnEnd] = []
        while self._keys and not ends:
            responses = self.generator.next_generated()
            if on_step is not None:
                on_step()
            if not responses:
                raise RuntimeError(f"generation stopped with {len(self._keys)} turns unfinished")
            for response, value in zip(responses, _sampled_logprobs(responses)):
                tokens, logprobs = self._sampled[response.uid]
                tokens.append(int(response.token))
                logprobs.append(value)
                if response.finish_reason is not None:
                    ends.append(TurnEnd(self._keys.pop(response.uid), tokens, logprobs, response.finish_reason,
                                        response.prompt_cache, list(response.all_tokens)))
                    del self._sampled[response.uid]
            if one_step:
                break
        return ends

    @property
    def decoding(self) -> int:
        """Sequences in the batch now (or waiting for a slot in it)."""
        return len(self._keys)

    def close(self) -> None:
        self.generator.close()

    def _track(self, keys: Sequence[int], uids: Sequence[int]) -> None:
        for key, uid in zip(keys, uids):
            self._keys[uid] = key
            self._sampled[uid] = ([], [])


# Below this many logprobs per step, one stacked gather beats a gather per row.
STACKED_GATHER_MAX_ELEMENTS = 1 << 18


def _sampled_logprobs(responses: list) -> list[float]:
    """Each response's logprob of its sampled token, for one decoding step in one evaluation.

    A small vocabulary stacks the rows and gathers once (fewest operations); a
    real one gathers a scalar per row, since stacking would copy a [B, V] array
    every step (39 MB for 64 rows at V = 151,936).
    """
    ids = [int(response.token) for response in responses]
    if len(responses) * responses[0].logprobs.size <= STACKED_GATHER_MAX_ELEMENTS:
        rows = mx.stack([response.logprobs for response in responses])
        picked = mx.take_along_axis(rows, mx.array(ids, dtype=mx.int32)[:, None], axis=1)[:, 0]
    else:
        picked = mx.stack([response.logprobs[token] for response, token in zip(responses, ids)])
    return cast(list[float], picked.astype(mx.float32).tolist())  # a 1-D array's tolist is a list of floats


def completion_text(tokenizer: Any, completion: GeneratedCompletion, eos_ids: set[int]) -> str:
    """Decode a completion for scoring, without its stop token (the learner decodes the same way to check)."""
    return decode_completion(tokenizer, completion.tokens, completion.finish_reason, eos_ids)
