"""Real-model rows, actor side: one lease's decode speed against `mlx_lm.batch_generate`.

The actor's own path (`generate_groups`: G completions per prompt in one
continuous batch, recording every sampled token's logprob, EOS included) runs
one lease on a real pretrained model; `mlx_lm.batch_generate`, the library the
actor wraps, then generates the same prompts (each repeated G times, so the
same batch size) with the same max tokens and sampling temperature. The fleet
must not lose to it (goal >= 1.0x).

Tokens are counted alike on both sides: every decoding step's output,
including the stop token. `batch_generate` drops the EOS token from what it
returns, so a completion it returns shorter than max_tokens counts one more.

The idle-slot share is the fraction of (decoding step x batch slot) cells whose
sequence had already finished while others in the batch were still decoding:
the price of a static batch that waits for its longest completion.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.models.realshape import default_cache_dir
from grpo_fleet.models.zoo import import_source

REAL_MODEL = "zoo:smollm2-135m-instruct"
REAL_MODEL_ENV = "GRPO_FLEET_REAL_MODEL"
GSM8K_MINI = Path(__file__).resolve().parents[1] / "tasks" / "data" / "gsm8k_mini.jsonl"


def real_model_dir(path: Optional[Path] = None) -> Path:
    """The real model's mlx-lm directory: `path`, else $GRPO_FLEET_REAL_MODEL, else SmolLM2-135M-Instruct
    from the zoo, imported once into the model cache (as an actor on this machine would)."""
    if path is not None:
        return Path(path)
    if os.environ.get(REAL_MODEL_ENV):
        return Path(os.environ[REAL_MODEL_ENV])
    return import_source(REAL_MODEL, default_cache_dir())


@dataclass(frozen=True)
class LeaseShape:
    """One lease: `prompts` prompts x G completions of at most `max_tokens`, at `temperature`."""

    prompts: int = 4
    group_size: int = 8
    max_tokens: int = 64
    temperature: float = 1.0  # the demo's

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size


def idle_slot_share(lengths: Sequence[int], batch_size: Optional[int] = None) -> float:
    """Share of (step x slot) cells left idle by finished sequences, in a continuous batch of `batch_size` slots.

    Sequences of `lengths` decoding steps each take free slots in order; a slot
    frees when its sequence ends and the next waiting sequence takes it on the
    following step (as mlx-lm's `BatchGenerator` refills). Once nothing waits,
    a finished sequence's slot stays idle until the longest running one ends.
    """
    lengths = [int(n) for n in lengths]
    if not lengths:
        return 0.0
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sequence decodes at least one step, got {min(lengths)}")
    slots = len(lengths) if batch_size is None else min(batch_size, len(lengths))
    ends = [0] * slots  # the step at which each slot's current sequence ends
    for index, length in enumerate(lengths):
        slot = index if index < slots else min(range(slots), key=ends.__getitem__)
        ends[slot] += length
    steps = max(ends)
    return 1.0 - sum(lengths) / (steps * slots)


def returned_token_count(token_ids: Sequence[int], max_tokens: int) -> int:
    """Decoding steps behind one `batch_generate` completion: it drops the stop token, so a short one ran one more."""
    return len(token_ids) + (1 if len(token_ids) < max_tokens else 0)


def lease_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The first `count` GSM8K-mini questions through the model's chat template."""
    from grpo_fleet.tasks.prompts import encode_prompt

    lines = GSM8K_MINI.read_text().splitlines()[:count]
    return [encode_prompt(tokenizer, json.loads(line)["question"], chat_template=True) for line in lines]


@dataclass
class DecodeRun:
    """One timed generation of a lease: per-completion decoding steps and wall seconds."""

    lengths: list[int]
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return sum(self.lengths) / self.seconds


def actor_lease(model: Any, prompts: list[list[int]], shape: LeaseShape, eos: Sequence[int]) -> DecodeRun:
    """The actor's path: `generate_groups`, logprobs recorded, EOS kept."""
    from grpo_fleet.models.generation import SamplingSettings, generate_groups

    settings = SamplingSettings(group_size=shape.group_size, max_tokens=shape.max_tokens,
                                temperature=shape.temperature, stop_token_ids=tuple(eos))
    start = time.perf_counter()
    groups = generate_groups(model, prompts, settings)
    seconds = time.perf_counter() - start
    return DecodeRun([len(c.tokens) for group in groups for c in group], seconds)


def library_lease(model: Any, tokenizer: Any, prompts: list[list[int]], shape: LeaseShape) -> DecodeRun:
    """`mlx_lm.batch_generate` on each prompt G times, same batch size, max tokens and temperature."""
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    rows = [list(p) for p in prompts for _ in range(shape.group_size)]
    start = time.perf_counter()
    response = batch_generate(model, tokenizer, rows, max_tokens=shape.max_tokens, return_token_ids=True,
                              sampler=make_sampler(temp=shape.temperature), completion_batch_size=len(rows),
                              prefill_batch_size=len(rows))
    seconds = time.perf_counter() - start
    assert response.token_ids is not None  # asked for with return_token_ids
    return DecodeRun([returned_token_count(ids, shape.max_tokens) for ids in response.token_ids], seconds)


def measure(report: Report, model_dir: Path, shape: LeaseShape, repeats: int) -> DecodeRun:
    """Best of `repeats` alternating runs of each side, after a warm-up of each; returns the actor's best run."""
    import mlx.core as mx

    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(model_dir))
    tokenizer = policy.tokenizer
    prompts = lease_prompts(tokenizer, shape.prompts)
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    warm = LeaseShape(shape.prompts, shape.group_size, 4, shape.temperature)
    actor_lease(policy.model, prompts, warm, eos)
    library_lease(policy.model, tokenizer, prompts, warm)
    actor_runs, library_runs = [], []
    for turn in range(repeats):
        mx.random.seed(turn)
        actor_runs.append(actor_lease(policy.model, prompts, shape, eos))
        mx.random.seed(turn)
        library_runs.append(library_lease(policy.model, tokenizer, prompts, shape))
        print(f"  turn {turn}: actor {actor_runs[-1].tokens_per_second:.1f} tok/s, "
              f"batch_generate {library_runs[-1].tokens_per_second:.1f} tok/s", flush=True)
    actor = max(actor_runs, key=lambda r: r.tokens_per_second)
    library = max(library_runs, key=lambda r: r.tokens_per_second)
    label = f"{model_dir.name}, {shape.prompts} prompts x G={shape.group_size}, max_tokens {shape.max_tokens}"
    report.add(Figure(
        "real_decode", f"actor lease tok/s, {label}", actor.tokens_per_second, "tok/s",
        baseline=library.tokens_per_second, baseline_name="mlx_lm.batch_generate tok/s", goal=">= 1.0x",
        notes=f"best of {repeats}; T={shape.temperature}; GSM8K-mini prompts of "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens (chat template); actor {sum(actor.lengths)} "
              f"tokens in {actor.seconds:.2f}s, batch_generate {sum(library.lengths)} in {library.seconds:.2f}s; "
              "tokens include the stop token on both sides",
    ))
    report.add(Figure(
        "real_decode", f"idle batch slots, {label}", 100 * idle_slot_share(actor.lengths), "%",
        notes=f"finished sequences waiting for the longest one; completion lengths {min(actor.lengths)}-"
              f"{max(actor.lengths)} (mean {sum(actor.lengths) / len(actor.lengths):.1f})",
    ))
    return actor


def run(report: Report, scale: Scale, model_dir: Optional[Path] = None) -> None:
    shape = LeaseShape(max_tokens=16) if scale is Scale.QUICK else LeaseShape()
    directory = real_model_dir(model_dir)
    if not (directory / "config.json").exists():
        print(f"skipping real_decode: no model at {directory} (set {REAL_MODEL_ENV})", flush=True)
        return
    measure(report, directory, shape, repeats={Scale.QUICK: 1, Scale.DEFAULT: 2}.get(scale, 3))
