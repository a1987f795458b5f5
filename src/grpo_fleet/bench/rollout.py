"""Benchmark 1: actor rollout throughput, G = 8 completions per prompt.

Figures, each measured against its baseline in the same run:

* tokens/s of `generate_groups` (what actors run) against a naive loop that
  calls mlx_lm's `generate_step` once per completion, with the same sampler,
  temperature 1.0, max_tokens and prompts, on the tiny demo model (demo length
  and a 64-token setting) and on a ~50M-parameter model;
* tokens/s of the shared-prefix prefill against prefilling G copies of every
  prompt, with ~256-token prompts (128 in quick mode) on the ~50M model.
  `generate_groups` shares prompts of at least SHARED_PREFIX_MIN_TOKENS tokens,
  so the throughput figures above use the G-copies path for the demo's 4-token
  prompts and the shared path for the ~50M model's 48-token prompts.

Both models are random-init llama models built by `build_tiny_model` into a
temporary directory. Settings other than the demo one pass no stop tokens, so
every completion runs the full max_tokens on both sides and the two methods
produce the same number of tokens. The naive loop is sequential, so its rate
does not depend on how many completions it runs; quick mode times it on a
subset to stay short (the notes say how many).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.config import TaskConfig, TinyModelConfig
from grpo_fleet.models.generation import (
    SHARED_PREFIX_MIN_TOKENS,
    GeneratedCompletion,
    SamplingSettings,
    encode_prompt,
    generate_groups,
    sampler_and_processors,
)
from grpo_fleet.models.loading import Policy, load_policy, parameter_count
from grpo_fleet.models.tiny_model import build_tiny_model

GROUP_SIZE = 8
NAIVE_NAME = "naive mlx_lm.generate loop"
# ~50M parameters: 10 blocks of 4*640^2 (attention) + 3*640*1728 (MLP) ~= 4.96M each.
BIG_MODEL = TinyModelConfig(hidden_size=640, num_layers=10, num_heads=10, intermediate_size=1728, vocab_size=512)


@dataclass
class Case:
    """One rollout setting: the prompts of a lease and how they are sampled."""

    name: str
    prompts: list[list[int]]
    settings: SamplingSettings
    naive_completions: int  # how many of the len(prompts) * G completions the naive loop times
    notes: str


def run(report: Report, scale: Scale) -> None:
    """Measure every figure of this benchmark into `report`; quick sizes finish in well under a minute."""
    quick = scale is Scale.QUICK
    with tempfile.TemporaryDirectory(prefix="grpo-bench-rollout-") as tmp:
        tiny = _tiny_policy(Path(tmp) / "tiny")
        for case in _tiny_cases(tiny, quick):
            # Tens of milliseconds a call: more repeats are cheap and steady the best-of.
            _compare_with_naive(report, tiny, case, repeats=2 if quick else 5)
        if scale is Scale.DEFAULT:  # the ~50M model's rows take minutes: `make bench-full` runs them
            return
        big = _big_policy(Path(tmp) / "big")
        params = parameter_count(big.model)
        _compare_with_naive(report, big, _big_case(big, quick, params), repeats=1 if quick else 2)
        _compare_prefill(report, big, quick, params)


# --------------------------------------------------------------------------- models and prompts


def _reverse_task_texts() -> tuple[list[str], list[str]]:
    """The demo's reverse task: (tokenizer corpus, prompt texts)."""
    from grpo_fleet.learner.run.build import tokenizer_corpus
    from grpo_fleet.tasks import build_task

    task = build_task(TaskConfig(name="reverse", digits=3, num_train=800, num_eval=128))
    return tokenizer_corpus(task), [ex.prompt for ex in task.train if isinstance(ex.prompt, str)]


def _tiny_policy(out: Path) -> Policy:
    corpus, _ = _reverse_task_texts()
    return load_policy(str(build_tiny_model(out, TinyModelConfig(), corpus)))


def _synthetic_text(words: int, seed: int) -> str:
    """Deterministic word salad with a skewed alphabet, so BPE learns a few hundred merges."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [1.0 / (rank + 1) for rank in range(len(letters))]
    return " ".join("".join(rng.choices(letters, weights, k=rng.randint(2, 8))) for _ in range(words))


def _big_policy(out: Path) -> Policy:
    corpus = [_synthetic_text(40, seed) for seed in range(400)]
    return load_policy(str(build_tiny_model(out, BIG_MODEL, corpus)))


def _text_prompts(policy: Policy, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens."""
    prompts = []
    for i in range(count):
        tokens = encode_prompt(policy.tokenizer, _synthetic_text(4 * length, seed + i), chat_template=False)
        prompts.append(tokens[:length])
    return prompts


def _tiny_cases(policy: Policy, quick: bool) -> list[Case]:
    _, texts = _reverse_task_texts()
    prompts = [encode_prompt(policy.tokenizer, t, chat_template=False) for t in texts[:4]]
    eos = tuple(sorted(policy.tokenizer.eos_token_ids))
    total = len(prompts) * GROUP_SIZE
    demo = SamplingSettings(group_size=GROUP_SIZE, max_tokens=5, temperature=1.0, stop_token_ids=eos)
    long = SamplingSettings(group_size=GROUP_SIZE, max_tokens=64, temperature=1.0)
    return [
        Case("tiny demo model, demo setting", prompts, demo, total,
             f"4 reverse prompts x G={GROUP_SIZE}, max_tokens 5, EOS stops (as in the demo)"),
        Case("tiny demo model, 64 tokens", prompts, long, total if not quick else 8,
             f"4 reverse prompts x G={GROUP_SIZE}, max_tokens 64, no stop tokens (every completion runs 64)"),
    ]


def _big_case(policy: Policy, quick: bool, params: int) -> Case:
    count, max_tokens, naive = (2, 16, 2) if quick else (4, 64, 8)
    settings = SamplingSettings(group_size=GROUP_SIZE, max_tokens=max_tokens, temperature=1.0)
    return Case(
        "~50M model, 48-token prompts", _text_prompts(policy, count, 48, seed=1), settings, naive,
        f"{params / 1e6:.1f}M params (vocab {policy.vocab_size}), {count} prompts x G={GROUP_SIZE}, "
        f"max_tokens {max_tokens}, no stop tokens",
    )


# --------------------------------------------------------------------------- timing


def _best_rates(fns: list[Callable[[], int]], repeats: int) -> list[tuple[float, float]]:
    """(tokens/s, seconds) of the fastest of `repeats` timed calls of each fn; a fn returns its token count.

    Calls alternate between the fns so that load from other work on a shared
    machine falls on all of them alike; the best run is the least disturbed one.
    """
    best = [(0.0, float("inf"))] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            mx.random.seed(0)
            start = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - start
            if tokens / seconds > best[i][0]:
                best[i] = (tokens / seconds, seconds)
    return best


def _batched(policy: Policy, case: Case, min_shared_prefix: Optional[int] = SHARED_PREFIX_MIN_TOKENS) -> Callable[[], int]:
    def go() -> int:
        groups = generate_groups(policy.model, case.prompts, case.settings, min_shared_prefix=min_shared_prefix)
        return sum(len(c.tokens) for group in groups for c in group)

    return go


def naive_completion(model: Any, prompt: list[int], settings: SamplingSettings) -> GeneratedCompletion:
    """One completion from its own mlx_lm generation, recording logprobs as an actor must.

    The baseline of the rollout benchmark and of the notebook-style loop in the
    end-to-end benchmark: no batching, no shared prefill.
    """
    from mlx_lm.generate import generate_step

    sampler, processors = sampler_and_processors(settings)
    stops = set(settings.stop_token_ids)
    tokens, logprobs, finish = [], [], "length"
    for token, row in generate_step(mx.array(prompt), model, max_tokens=settings.max_tokens,
                                    sampler=sampler, logits_processors=processors):
        tokens.append(int(token))
        logprobs.append(row[token])
        if token in stops:
            finish = "stop"
            break
    mx.eval(logprobs)
    return GeneratedCompletion(tokens, [float(x) for x in logprobs], finish)


def _naive(policy: Policy, case: Case) -> Callable[[], int]:
    jobs = [p for p in case.prompts for _ in range(GROUP_SIZE)][: case.naive_completions]

    def go() -> int:
        return sum(len(naive_completion(policy.model, prompt, case.settings).tokens) for prompt in jobs)

    return go


def _compare_with_naive(report: Report, policy: Policy, case: Case, repeats: int = 2) -> None:
    warm = Case(case.name, case.prompts[:1], case.settings, 1, case.notes)
    # First calls allocate buffers and load kernels: keep them out of the timing.
    _batched(policy, warm)()
    _naive(policy, warm)()
    (batched_tps, batched_s), (naive_tps, naive_s) = _best_rates([_batched(policy, case), _naive(policy, case)], repeats)
    total = len(case.prompts) * GROUP_SIZE
    report.add(Figure(
        benchmark="rollout", name=f"rollout tok/s, {case.name}", value=batched_tps, unit="tok/s",
        baseline=naive_tps, baseline_name=NAIVE_NAME, goal=">= 5x",
        notes=f"{case.notes}; generate_groups {batched_s:.2f}s for {total} completions, "
        f"naive {naive_s:.2f}s for {case.naive_completions}; best of {repeats}",
    ))


def _compare_prefill(report: Report, policy: Policy, quick: bool, params: int) -> None:
    """Shared-prefix prefill against G copies, on long prompts where prefill dominates.

    The ~50M model is already warm from the throughput comparison.
    """
    count, length, max_tokens = (2, 128, 4) if quick else (4, 256, 16)
    settings = SamplingSettings(group_size=GROUP_SIZE, max_tokens=max_tokens, temperature=1.0)
    case = Case("prefill", _text_prompts(policy, count, length, seed=100), settings, 0, "")
    shared, copies = _batched(policy, case), _batched(policy, case, min_shared_prefix=None)
    (shared_tps, shared_s), (copies_tps, copies_s) = _best_rates([shared, copies], 1 if quick else 2)
    report.add(Figure(
        benchmark="rollout", name=f"shared-prefix rollout tok/s, ~50M model, {length}-token prompts",
        value=shared_tps, unit="tok/s", baseline=copies_tps, baseline_name="G-copies prefill",
        goal="> 1x",
        notes=f"{params / 1e6:.1f}M params, {count} prompts x G={GROUP_SIZE}, max_tokens {max_tokens}, "
        f"no stop tokens; lease wall time {shared_s:.2f}s shared vs {copies_s:.2f}s copies",
    ))
