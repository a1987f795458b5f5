"""Real-model rows, actor side at long answers: the rolling actor against `mlx_lm.batch_generate`, lease after lease.

Each lease is 4 prompts x G = 8, so 32 completions of up to `max_tokens`:
two GSM8K-mini questions (worked solutions, hundreds of tokens) and two that a
chat model answers in a few words, so that lengths vary within a lease as a
reasoning task's do, and with the sample (T = 1).
`batch_generate` does each lease as the actor used to: one static batch of 32
that waits for its longest completion. The rolling actor (actor/rolling.py)
keeps one batch of 32 slots across leases: the next lease is queued as soon as
nothing else waits, and takes each slot the step after it frees.

Two figures for the rolling side: its tok/s and idle slots while more work
waited (an actor in a fleet always has its next lease in hand; this is its
steady state), and the same over the whole stream, the last lease's tail
included (what a drain for a new policy version costs). Tokens are counted
alike on both sides, the stop token included (see real_decode.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.real_decode import REAL_MODEL_ENV, DecodeRun, LeaseShape, lease_prompts, library_lease, real_model_dir

# Questions a chat model answers in a few words, half of each lease: with the GSM8K ones (a worked solution of
# hundreds of tokens) a lease's lengths spread as a reasoning task's do, from a handful of tokens to max_tokens.
SHORT_QUESTIONS = (
    "What is the capital of France? Answer in one word.",
    "Is water wet? Answer yes or no.",
    "What color is the sky on a clear day? One word.",
    "How many legs does a spider have? Give only the number.",
    "Name the largest planet in the solar system, in one word.",
    "What is 2 + 2? Give only the number.",
)


def stream_leases(tokenizer: Any, stream: "StreamShape") -> list[list[list[int]]]:
    """Each lease's prompts: GSM8K-mini questions and short ones in turn, different in every lease."""
    from grpo_fleet.tasks.prompts import encode_prompt

    count = stream.leases * stream.lease.prompts
    long = lease_prompts(tokenizer, count)
    short = [encode_prompt(tokenizer, SHORT_QUESTIONS[i % len(SHORT_QUESTIONS)], chat_template=True)
             for i in range(count)]
    mixed = [long[i] if i % 2 == 0 else short[i] for i in range(count)]
    return [mixed[i : i + stream.lease.prompts] for i in range(0, count, stream.lease.prompts)]


@dataclass(frozen=True)
class StreamShape:
    """`leases` leases of one `lease` shape each, on different questions."""

    leases: int = 3
    lease: LeaseShape = LeaseShape(prompts=4, group_size=8, max_tokens=256)


@dataclass
class Window:
    """Decoding steps, the rows they decoded, the batch slots they had (rolling.SlotUsage), wall seconds."""

    steps: int
    rows: int  # = tokens
    slots: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.rows / self.slots if self.slots else 0.0


def rolling_stream(model: Any, leases: Sequence[list[list[int]]], shape: LeaseShape,
                   eos: Sequence[int]) -> tuple[Window, Window]:
    """(while work waited, whole stream) for every lease through one rolling generator of one lease's slots."""
    from grpo_fleet.actor.rolling import RollingGenerator
    from grpo_fleet.models.generation import SamplingSettings
    from grpo_fleet.models.native_functions import use_native_decoding

    settings = SamplingSettings(group_size=shape.group_size, max_tokens=shape.max_tokens,
                                temperature=shape.temperature, stop_token_ids=tuple(eos))
    use_native_decoding(model)  # as the actor's worker does; batch_generate's side keeps mlx-lm's own
    try:
        return _roll(RollingGenerator(model, settings, batch_size=shape.sequences), leases)
    finally:
        use_native_decoding(model, False)


def _roll(generator: Any, leases: Sequence[list[list[int]]]) -> tuple[Window, Window]:
    """Feed the leases to `generator` as its slots free; (while work waited, whole stream)."""
    waiting, usage = list(enumerate(leases)), generator.usage
    start = time.perf_counter()
    steady = Window(0, 0, 0, 0.0)
    try:
        while waiting or not generator.idle:
            while waiting and generator.wants_work:
                key, prompts = waiting.pop(0)
                generator.add(key, prompts, version=0)
                if not waiting:  # from here on nothing waits for a slot that frees
                    steady = Window(usage.steps, usage.rows, usage.slots, time.perf_counter() - start)
            generator.step()
    finally:
        generator.close()
    return steady, Window(usage.steps, usage.rows, usage.slots, time.perf_counter() - start)


def static_stream(model: Any, tokenizer: Any, leases: Sequence[list[list[int]]], shape: LeaseShape) -> Window:
    """`batch_generate` lease by lease, each a static batch of its 32 rows; steps are each lease's longest."""
    runs: list[DecodeRun] = [library_lease(model, tokenizer, prompts, shape) for prompts in leases]
    steps = sum(max(run.lengths) for run in runs)
    rows = sum(sum(run.lengths) for run in runs)
    return Window(steps, rows, steps * shape.sequences, sum(run.seconds for run in runs))


def measure(report: Report, model_dir: Path, stream: StreamShape) -> None:
    """The static side, then the rolling side, on the same leases (each after a short warm-up)."""
    import mlx.core as mx

    from grpo_fleet.models.loading import load_policy

    policy = load_policy(str(model_dir))
    shape = stream.lease
    leases = stream_leases(policy.tokenizer, stream)
    eos = sorted(int(t) for t in policy.tokenizer.eos_token_ids)
    warm = LeaseShape(shape.prompts, shape.group_size, 4, shape.temperature)
    rolling_stream(policy.model, leases[:1], warm, eos)
    static_stream(policy.model, policy.tokenizer, leases[:1], warm)
    mx.random.seed(0)
    static = static_stream(policy.model, policy.tokenizer, leases, shape)
    print(f"  batch_generate: {static.rows} tokens in {static.seconds:.1f}s", flush=True)
    mx.random.seed(0)
    steady, whole = rolling_stream(policy.model, leases, shape, eos)
    print(f"  rolling: {whole.rows} tokens in {whole.seconds:.1f}s", flush=True)
    _report(report, model_dir, stream, static, steady, whole)


def _report(report: Report, model_dir: Path, stream: StreamShape, static: Window, steady: Window, whole: Window) -> None:
    shape = stream.lease
    label = (f"{model_dir.name}, {stream.leases} leases of {shape.prompts} prompts x G={shape.group_size}, "
             f"max_tokens {shape.max_tokens}, T={shape.temperature}")
    static_idle = f"batch_generate's static batches left {100 * static.idle_fraction:.1f}% of slots idle"
    tail = (whole.slots - whole.rows) - (steady.slots - steady.rows)
    report.add(Figure(
        "long_decode", f"rolling actor tok/s while work waited, {label}", steady.tokens_per_second, "tok/s",
        baseline=static.tokens_per_second, baseline_name="mlx_lm.batch_generate tok/s, lease by lease",
        goal=">= 1.3x", notes=f"{steady.rows} tokens in {steady.seconds:.1f}s over {steady.steps} steps before the "
        f"last lease was queued; batch_generate {static.rows} tokens in {static.seconds:.1f}s; {static_idle}",
    ))
    report.add(Figure(
        "long_decode", f"rolling actor tok/s, whole stream with its last tail, {label}", whole.tokens_per_second,
        "tok/s", baseline=static.tokens_per_second, baseline_name="mlx_lm.batch_generate tok/s, lease by lease",
        notes=f"{whole.rows} tokens in {whole.seconds:.1f}s over {whole.steps} steps",
    ))
    report.add(Figure(
        "long_decode", f"rolling actor idle batch slots while work waited, {label}", 100 * steady.idle_fraction, "%",
        baseline=100 * static.idle_fraction, baseline_name="batch_generate idle slots %", goal="<= 5%",
        notes=f"whole stream, last tail included: {100 * whole.idle_fraction:.1f}%; that tail (what one drain for a "
              f"new policy version costs) left {tail} slot-steps idle, {tail / shape.sequences:.0f} steps' worth",
    ))


def run(report: Report, scale: Scale, model_dir: Optional[Path] = None) -> None:
    stream = StreamShape(2, LeaseShape(max_tokens=32)) if scale is Scale.QUICK else StreamShape()
    if scale is Scale.FULL:
        stream = StreamShape(4, LeaseShape(max_tokens=512))
    directory = real_model_dir(model_dir)
    if not (directory / "config.json").exists():
        print(f"skipping long_decode: no model at {directory} (set {REAL_MODEL_ENV})", flush=True)
        return
    measure(report, directory, stream)

