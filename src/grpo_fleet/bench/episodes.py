"""Episodes against single-turn groups on the same real model (issue 28): the actor's decode and the learner's step.

The same held-out capital questions (the real-model demo's), sampled on the same
model two ways: single-turn groups (`generate_groups`, G replies per prompt) and
CapitalQuiz episodes (`EpisodeRunner`, G episodes per prompt, up to 2 turns, the
environment in this process). Reported for each: sampled tokens per second of
the whole lease, environment tokens per second, the seconds spent in
environment calls and the share of (decoding step x batch slot) cells left idle
while the episodes' environments stepped (every slot waits: the runner steps
the environments between decoding steps), and one learner step (LoRA r8) on
the lease as the learner would train it (environment tokens masked). And the
learner's replay of the lease's episodes (security.verify_rewards), in the child
process it runs in against this process (where it ran before issue 39).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.real_decode import real_model_dir
from grpo_fleet.envs.hosting import EnvAnswer, EnvCalls, InlineEnvs
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.models.generation import GeneratedCompletion

DEMO = Path(__file__).resolve().parents[1] / "demos" / "smollm2-135m-instruct"
SYSTEM = "Answer in one short sentence."


class TimedEnvs:
    """The environments, with the wall time of their calls."""

    def __init__(self, envs: InlineEnvs) -> None:
        self.envs, self.seconds = envs, 0.0

    def run_envs(self, calls: EnvCalls) -> list[EnvAnswer]:
        started = time.perf_counter()
        try:
            return self.envs.run_envs(calls)
        finally:
            self.seconds += time.perf_counter() - started

    def submit(self, calls: EnvCalls) -> None:
        started = time.perf_counter()
        self.envs.submit(calls)  # in this process, the calls run here and now: every slot waits for them
        self.seconds += time.perf_counter() - started

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]:
        return self.envs.collect(wait_seconds)


def _examples(count: int) -> list[dict[str, Any]]:
    lines = (DEMO / "capitals_eval.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:count]]


def _group(index: int, prompt: list[int], completions: list[GeneratedCompletion]) -> AcceptedGroup:
    """A lease's group as the learner keeps it (an episode's marks too); rewards spread 0..1 so that it trains."""
    size = len(completions)
    records = []
    for i, c in enumerate(completions):
        marks = c.episode
        records.append(CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32),
                                        i / max(1, size - 1), c.finish_reason,
                                        mask=None if marks is None else np.asarray(marks.mask, np.uint8),
                                        turns=None if marks is None else list(marks.turns),
                                        end="" if marks is None else marks.end))
    return AcceptedGroup(group_id=f"g{index}", prompt_index=index, prompt_tokens=np.asarray(prompt, np.int32),
                         completions=records, policy_version=0, actor_id="bench")


def measure(report: Report, model_dir: Path, prompts: int, group_size: int, max_tokens: int) -> None:
    from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
    from grpo_fleet.envs.protocol import env_extras
    from grpo_fleet.envs.runner import EpisodeLimits, EpisodeRunner, EpisodeStart
    from grpo_fleet.learner.step.batch import build_train_batch
    from grpo_fleet.learner.step.trainer import Trainer
    from grpo_fleet.models.generation import SamplingSettings, generate_groups
    from grpo_fleet.models.loading import load_policy
    from grpo_fleet.tasks.env_module import EnvSetup
    from grpo_fleet.tasks.prompts import chat_messages, encode_prompt

    policy = load_policy(str(model_dir), lora=LoraConfig(enabled=True, rank=8))
    tokenizer = policy.tokenizer
    examples = _examples(prompts)
    ids = [encode_prompt(tokenizer, ex["prompt"], chat_template=True, system_prompt=SYSTEM) for ex in examples]
    settings = SamplingSettings(group_size=group_size, max_tokens=max_tokens, temperature=1.0,
                                stop_token_ids=sorted(int(t) for t in tokenizer.eos_token_ids))
    mx.random.seed(0)
    started = time.perf_counter()
    single = generate_groups(policy.model, ids, settings)
    single_seconds = time.perf_counter() - started
    single_tokens = sum(len(c.tokens) for g in single for c in g)

    setup = EnvSetup(module="grpo_fleet.envs.capital_quiz", class_name="CapitalQuiz", max_turns=2,
                     max_episode_tokens=4 * max_tokens + 64)
    envs = TimedEnvs(InlineEnvs(setup))
    runner = EpisodeRunner(policy.model, tokenizer, settings, EpisodeLimits(2, setup.max_episode_tokens), envs)
    starts = [EpisodeStart(p, chat_messages(ex["prompt"], SYSTEM), env_extras({}, ex["answer"], 2))
              for p, ex in zip(ids, examples)]
    mx.random.seed(0)
    started = time.perf_counter()
    episodes = runner.run(starts)
    episode_seconds = time.perf_counter() - started
    outcomes = [o for g in episodes for o in g]
    sampled = sum(sum(o.completion.episode.mask) for o in outcomes if o.completion.episode)
    environment = sum(len(o.completion.tokens) for o in outcomes) - sampled
    turns = float(np.mean([o.turns for o in outcomes]))
    label = f"{model_dir.name}, {prompts} prompts x G={group_size}, {max_tokens} tokens a turn"
    report.add(Figure("episodes", f"single-turn sampled tok/s, {label}", single_tokens / single_seconds, "tok/s",
                      notes=f"{single_tokens} tokens in {single_seconds:.1f}s"))
    report.add(Figure("episodes", f"episodes sampled tok/s, {label}", sampled / episode_seconds, "tok/s",
                      baseline=single_tokens / single_seconds, baseline_name="single-turn tok/s",
                      notes=f"{sampled} sampled + {environment} environment tokens in {episode_seconds:.1f}s; "
                            f"{turns:.2f} turns an episode; environment calls {envs.seconds:.2f}s"))
    report.add(Figure("episodes", f"episodes environment tok/s, {label}", environment / episode_seconds, "tok/s"))
    report.add(Figure("episodes", f"batch slots idle while environments step, {label}",
                      100 * envs.seconds / episode_seconds, "%",
                      notes="every slot waits while the turns that ended are stepped together"))

    replay_rows(report, label, tokenizer, setup, examples, [[o.completion for o in g] for g in episodes])

    trainer = Trainer(policy, GRPOConfig(), OptimConfig(), temperature=1.0, max_tokens=max_tokens)
    single_groups = [_group(i, p, list(g)) for i, (p, g) in enumerate(zip(ids, single))]
    episode_groups = [_group(i, p, [o.completion for o in g]) for i, (p, g) in enumerate(zip(ids, episodes))]
    trainer.step(build_train_batch(single_groups[:1]))  # warm-up
    for name, groups in (("single-turn", single_groups), ("episodes", episode_groups)):
        stats = trainer.step(build_train_batch(groups))
        tokens = sum(int(c.sampled.sum()) for g in groups for c in g.completions)
        report.add(Figure("episodes", f"learner step, {name}, {label}", stats.train_seconds, "s",
                          notes=f"{tokens} sampled tokens trained ({tokens / stats.train_seconds:.0f} tok/s)"))


def _replay_seconds(replay: Any, examples: list[dict[str, Any]], groups: list[list[Any]], rounds: int) -> float:
    """Seconds to replay every group `rounds` times, as the learner's reward check does (each must agree)."""
    from grpo_fleet.tasks import Example

    started = time.perf_counter()
    for _ in range(rounds):
        for ex, group in zip(examples, groups):
            replayed = replay.replay_group(Example(ex["prompt"], ex["answer"]), group)
            assert not any(r.problem or r.overran or r.failed for r in replayed), replayed
    return time.perf_counter() - started


def replay_rows(report: Report, label: str, tokenizer: Any, setup: Any, examples: list[dict[str, Any]],
                episodes: list[list[GeneratedCompletion]], rounds: int = 5) -> None:
    """The learner's replay of the lease's episodes (security.verify_rewards) in a child process, as it runs, and
    in this process, as it ran before issue 39: what killing a hung replay costs an honest group."""
    from grpo_fleet.actor.wire import to_completion
    from grpo_fleet.envs.process import EnvProcess
    from grpo_fleet.learner.verify.env_replay import EnvReplay

    groups = [[to_completion(c, 0.0) for c in g] for g in episodes]  # the reward check compares rewards, not this
    child = EnvProcess(setup)
    try:
        seconds = {"child": _replay_seconds(EnvReplay(setup, tokenizer, SYSTEM, child), examples, groups, rounds),
                   "inline": _replay_seconds(EnvReplay(setup, tokenizer, SYSTEM, InlineEnvs(setup)), examples, groups,
                                             rounds)}
    finally:
        child.close()
    per_group = {where: 1000 * s / (rounds * len(groups)) for where, s in seconds.items()}
    report.add(Figure("episodes", f"learner replay ms per group, child process, {label}", per_group["child"], "ms",
                      baseline=per_group["inline"], baseline_name="in the learner's process",
                      notes=f"{per_group['child'] / per_group['inline']:.2f}x in-process; two round trips a group "
                            "(every init, then every turn and close)"))


# The tool rows: turns long enough to matter, more episodes than decoding slots (a freed slot has work to take).
TOOL_TURNS, TOOL_TURN_TOKENS, TOOL_SLOTS = 3, 24, 32


def tool_delay_rows(report: Report, model_dir: Path, prompts: int, group_size: int, delay: float = 1.0) -> None:
    """Sampled tok/s with a tool that takes `delay` seconds a call against an instant one, the same episodes, in
    the actor's environment process (envs/pool.py: calls side by side), and the decoding slots left idle."""
    from grpo_fleet.config import LoraConfig
    from grpo_fleet.envs.process import EnvProcess
    from grpo_fleet.envs.protocol import env_extras
    from grpo_fleet.envs.runner import EpisodeLimits, EpisodeRunner, EpisodeStart
    from grpo_fleet.models.generation import SamplingSettings
    from grpo_fleet.models.loading import load_policy
    from grpo_fleet.tasks.env_module import EnvSetup
    from grpo_fleet.tasks.prompts import chat_messages, encode_prompt

    policy = load_policy(str(model_dir), lora=LoraConfig(enabled=True, rank=8))
    examples = _examples(prompts)
    ids = [encode_prompt(policy.tokenizer, ex["prompt"], chat_template=True, system_prompt=SYSTEM) for ex in examples]
    starts = [EpisodeStart(p, chat_messages(ex["prompt"], SYSTEM), env_extras({}, ex["answer"], TOOL_TURNS))
              for p, ex in zip(ids, examples)]
    # Every turn runs to its token limit (no stop token), so both runs decode the same number of tokens.
    settings = SamplingSettings(group_size=group_size, max_tokens=TOOL_TURN_TOKENS, temperature=1.0, stop_token_ids=[])
    label = (f"{model_dir.name}, {prompts} prompts x G={group_size}, {TOOL_TURNS} turns of {TOOL_TURN_TOKENS} "
             f"tokens, {TOOL_SLOTS} slots")
    rates, idle = {}, {}
    for name, seconds in (("instant", 0.0), (f"{delay:g} s", delay)):
        setup = EnvSetup(module="grpo_fleet.bench.slow_tool_env", class_name="SlowTool", max_turns=TOOL_TURNS,
                         max_episode_tokens=1024, timeout_seconds=delay + 30, config={"delay_seconds": seconds},
                         concurrency=prompts * group_size)
        envs = EnvProcess(setup)
        try:
            runner = EpisodeRunner(policy.model, policy.tokenizer, settings, EpisodeLimits(TOOL_TURNS, 1024), envs,
                                   batch_size=TOOL_SLOTS)
            mx.random.seed(0)
            started = time.perf_counter()
            outcomes = [o for g in runner.run(starts) for o in g]
            wall = time.perf_counter() - started
        finally:
            envs.close()
        sampled = sum(sum(o.completion.episode.mask) for o in outcomes if o.completion.episode)
        rates[name], idle[name] = sampled / wall, runner.slots
        report.add(Figure("episodes", f"sampled tok/s, tool {name} a call, {label}", rates[name], "tok/s",
                          baseline=rates.get("instant") if seconds else None, baseline_name="instant tool",
                          notes=f"{sampled} sampled tokens in {wall:.1f}s; decoding slots idle "
                                f"{100 * runner.slots.idle_share:.1f}% of the time, episodes waiting on the tool "
                                f"{runner.slots.tool_wait_seconds:.1f}s"))
    report.add(Figure("episodes", f"decoding slots idle while a {delay:g} s tool runs, {label}",
                      100 * idle[f"{delay:g} s"].idle_share, "%",
                      notes="slot-seconds left empty over slot-seconds the unfinished episodes could fill"))


def run(report: Report, scale: Scale, model_dir: Optional[Path] = None) -> None:
    directory = real_model_dir(model_dir)
    if not (directory / "config.json").exists():
        print(f"skipping episodes: no model at {directory}", flush=True)
        return
    prompts, group_size = (2, 4) if scale is Scale.QUICK else (8, 8)
    measure(report, directory, prompts, group_size, max_tokens=16)
    tool_delay_rows(report, directory, prompts, group_size)
