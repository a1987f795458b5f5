"""Issue 38: the default objective against the alternatives at long answers and the fleet's staleness; and beta = 0.

`bench/offpolicy.py`'s lagged loop (each batch sampled under the weights of
`lag` updates back, trained by `Trainer.step`) on SmolLM2-135M-Instruct with the
packaged long-answer recipe (demos/smollm2-135m-instruct/long-answers.toml: lists
of N countries with credit for every line, max_tokens 256, T 0.7, LoRA as it
says). The lag is what the simulator predicts for 8 Macs at 512 tokens
(docs/simulator.md's table, read from `fleetsim` here rather than copied): groups
train about 2 versions behind.

The arms (`arms`): the shipped defaults (`GRPOConfig()`'s objective and beta; the
recipe itself sets beta 0, the question is whether the package should), each other
objective the config offers at the default beta (and the decoupled objective's
sequence-level weight, the variant meant for long completions), and beta = 0 with
the default objective. The model is loaded once; every arm starts from the same
adapters with a fresh optimizer and the same sampling stream.

Per arm: held-out reward (the recipe's eval mode, a few of its held-out prompts)
before and after the step budget, mean reply tokens, the off-policy gap and clip
fraction at the lag, Trainer.step seconds and the pi_ref pass's share of them, and
the k3 KL to the reference (the base, adapters off) on the last batch, measured the
same way for every arm (on a batch the final weights sample), so beta 0 can be compared with beta > 0.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop, batched_rollout
from grpo_fleet.bench.offpolicy import OffPolicyStats, lagged_training
from grpo_fleet.bench.offpolicy_real import staleness_of
from grpo_fleet.bench.real_task import real_model_dir
from grpo_fleet.config import GRPOConfig, RunConfig, apply_overrides
from grpo_fleet.launch.demo import DemoOptions, demo_settings
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.step.batch import build_train_batch, split_batch
from grpo_fleet.learner.step.forward import frozen_logprobs
from grpo_fleet.learner.step.grpo import kl_k3
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.models.loading import Policy, adapters_disabled, load_policy

MODEL, RECIPE = "smollm2-135m-instruct", "long-answers"
# The simulator's reasoning shape (docs/simulator.md, "At reasoning lengths"): 8 Macs of actors, 512-token
# max_tokens, lognormal lengths, the 0.5B model at 2,000 tok/s on one learner rank.
SIM_MACS, SIM_MAX_TOKENS, SIM_LENGTHS, SIM_LEARNER_TOK_S = 8, 512, "lognormal:300:0.6:16", 2000.0


@dataclass(frozen=True)
class Sizes:
    steps: int
    groups: int  # groups a step (B)
    group_size: int  # G
    eval_prompts: int
    eval_samples: int
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()


# One core takes about 75 s per 1,000 completion tokens sampled and trained (bench/two_macs.py), so DEFAULT is
# 6 steps (the last four at staleness 2) of 2 x 4 for each of four arms, about 35 minutes; QUICK a smoke run
# at 64 tokens whose figures mean nothing.
SIZES = {
    Scale.QUICK: Sizes(3, 1, 4, 2, 1, (0,), ("generation.max_tokens=64",)),
    Scale.DEFAULT: Sizes(6, 2, 4, 4, 2, (0,)),
    Scale.FULL: Sizes(12, 4, 8, 16, 2, (0, 1, 2)),
}


@dataclass(frozen=True)
class Arm:
    """One configuration compared: a name and the grpo settings it changes from the recipe."""

    name: str
    grpo: dict[str, Any]


def arms(defaults: GRPOConfig, full: bool = False) -> list[Arm]:
    """The shipped default, beta 0 with the default objective, and each other objective at the default beta.

    The decoupled objective is also run with one behaviour weight per completion (is_level 'sequence'),
    the variant meant for long completions; `full` adds its masking mode too.
    """
    shipped = {"objective": defaults.objective, "beta": defaults.beta}
    out = [Arm(f"default ({defaults.objective}, beta {defaults.beta:g})", shipped)]
    if defaults.beta != 0:  # second: on a loaded machine the beta question should not wait for every objective
        out.append(Arm(f"beta 0 ({defaults.objective})", {**shipped, "beta": 0.0}))
    for objective in typing.get_args(GRPOConfig.model_fields["objective"].annotation):
        if objective == defaults.objective:
            continue
        out.append(Arm(objective, {**shipped, "objective": objective}))
        if objective == "decoupled":
            out.append(Arm(f"{objective}, sequence weights", {**shipped, "objective": objective, "is_level": "sequence"}))
            if full:
                out.append(Arm(f"{objective}, masked", {**shipped, "objective": objective, "is_mode": "mask"}))
    return out


def lag_from(mean_staleness: float) -> int:
    """The lag to run at: the simulator's mean versions behind, rounded, at least 1 (lag 0 is on-policy)."""
    return max(1, round(mean_staleness))


def simulated_staleness() -> tuple[float, float]:
    """(mean, p90) versions behind that trained groups are for SIM_MACS Macs at SIM_MAX_TOKENS (refilled rows)."""
    from dataclasses import replace

    from grpo_fleet.simulator.lengths import parse_lengths
    from grpo_fleet.simulator.plan import PlanInputs, PlanShape, plan_lengths

    shape = PlanShape(completion_tokens=SIM_MAX_TOKENS)
    shape = replace(shape, lengths=parse_lengths(SIM_LENGTHS, SIM_MAX_TOKENS))
    rows = plan_lengths(PlanInputs(learner_tok_s=SIM_LEARNER_TOK_S), shape, [SIM_MACS])
    result = next(row.result for row in rows if row.refill)
    return result.mean_staleness, result.staleness_p90


def long_config(run_dir: Path, model_dir: str, sizes: Sizes, seed: int) -> RunConfig:
    """The recipe's run config at `sizes`, on `model_dir`, with no evals or samples of its own."""
    data = demo_settings(DemoOptions(model=MODEL, config=RECIPE))
    overrides = [f"grpo.groups_per_step={sizes.groups}", f"generation.group_size={sizes.group_size}",
                 f"task.num_eval={sizes.eval_prompts}", f"train.eval_samples={sizes.eval_samples}",
                 f"train.steps={sizes.steps}", f"train.seed={seed}", "train.eval_every=0",
                 "train.log_samples_every=0", *sizes.overrides]
    cfg = RunConfig.model_validate(apply_overrides(data, overrides))
    return cfg.model_copy(update={"run_dir": str(run_dir), "model": cfg.model.model_copy(update={"path": model_dir})})


def with_arm(cfg: RunConfig, arm: Arm) -> RunConfig:
    return cfg.model_copy(update={"grpo": GRPOConfig.model_validate({**cfg.grpo.model_dump(), **arm.grpo})})


def reference_kl(policy: Policy, groups: list[AcceptedGroup], *, temperature: float, micro_batch_tokens: int,
                 chunk_tokens: int) -> float:
    """Mean k3 KL(pi_theta || pi_ref) over `groups`' completion tokens, pi_ref the base with adapters off: the
    trainer's own `kl` statistic, but measured for beta 0 too (whose steps skip pi_ref)."""
    micro = split_batch(build_train_batch(groups), micro_batch_tokens)
    policy_lp = frozen_logprobs(policy.model, micro, temperature=temperature, chunk_tokens=chunk_tokens)
    with adapters_disabled(policy.model):
        ref_lp = frozen_logprobs(policy.model, micro, temperature=temperature, chunk_tokens=chunk_tokens)
    total = sum(float(mx.sum(kl_k3(lp, ref) * m.mask)) for lp, ref, m in zip(policy_lp, ref_lp, micro))
    return total / max(sum(float(mx.sum(m.mask)) for m in micro), 1.0)


@dataclass
class ArmRun:
    """One (arm, seed) run."""

    arm: str
    seed: int
    lag: int
    final: float = float("nan")
    kl: float = float("nan")
    steps: list[tuple[int, StepStats]] = field(default_factory=list)  # (staleness it trained at, the step)
    reply_tokens: list[int] = field(default_factory=list)  # every training completion's length
    truncated: int = 0
    sampling_seconds: list[float] = field(default_factory=list)  # each step's rollout under the lagged weights

    def at(self, staleness: int) -> OffPolicyStats:
        return OffPolicyStats.of([s for k, s in self.steps if k == staleness])

    @property
    def warm(self) -> list[StepStats]:
        """The steps after the first, whose shapes and buffers the first one set up (and paid for)."""
        return [s for _, s in self.steps[1:]] or [s for _, s in self.steps]

    @property
    def step_seconds(self) -> float:
        return statistics.median(s.train_seconds for s in self.warm)

    @property
    def ref_share(self) -> float:
        return sum(s.ref_seconds for s in self.warm) / max(sum(s.train_seconds for s in self.warm), 1e-9)


def held_out(loop: TrainLoop, seed: int) -> float:
    mx.random.seed(10_000 + seed)  # every arm's eval draws the same samples for the same weights
    return loop.held_out()


def one_run(cfg: RunConfig, policy: Policy, start: list[Any], arm: Arm, lag: int) -> ArmRun:
    """`arm` trained from the adapters `start` with a fresh optimizer at `lag`; held-out at the end."""
    policy.model.update(tree_unflatten(list(start)))
    out, mark = ArmRun(arm.name, cfg.train.seed, lag), [time.perf_counter()]

    def seen(batch: list[AcceptedGroup]) -> None:
        out.sampling_seconds.append(time.perf_counter() - mark[0])
        records = [c for g in batch for c in g.completions]
        out.reply_tokens += [len(c.tokens) for c in records]
        out.truncated += sum(c.finish_reason == "length" for c in records)

    def progress(step: int, stats: StepStats) -> None:
        mark[0] = time.perf_counter()
        out.steps.append((staleness_of(step, lag), stats))
        print(f"offpolicy_long {arm.name} seed {out.seed} step {step}: staleness {staleness_of(step, lag)}, gap mean "
              f"{stats.offpolicy_gap_mean:.4f} max {stats.offpolicy_gap_max:.3f}, clip {stats.clip_fraction}, capped "
              f"{stats.is_capped_fraction:.4f}, kl {stats.kl}, step {stats.train_seconds:.1f} s (pi_ref "
              f"{stats.ref_seconds:.1f} s), replies so far {statistics.fmean(out.reply_tokens):.0f} tokens", flush=True)

    mx.random.seed(cfg.train.seed)  # the same sampling stream for every arm at a seed
    loop = TrainLoop.around(cfg, policy)
    lagged_training(loop, lag, eval_every=cfg.train.steps + 1, on_step=progress, on_batch=seen)
    # k3 is unbiased only on samples of pi_theta itself: a batch of the final weights, not a lagged training one
    fresh = loop.batch(loop.policy, batched_rollout)
    out.kl = reference_kl(policy, fresh, temperature=cfg.generation.temperature,
                          micro_batch_tokens=cfg.train.micro_batch_tokens, chunk_tokens=cfg.train.logprob_chunk_tokens)
    out.final = held_out(loop, out.seed)
    print(f"offpolicy_long {arm.name} seed {out.seed}: held-out {out.final:.3f}, KL to pi_ref {out.kl:.5f}", flush=True)
    return out


def run(report: Report, scale: Scale) -> None:
    sizes = SIZES[scale]
    load_before = os.getloadavg()
    mean, p90 = simulated_staleness()
    lag = lag_from(mean)
    print(f"offpolicy_long: simulator, {SIM_MACS} Macs at {SIM_MAX_TOKENS} tokens: {mean:.2f} versions behind "
          f"(p90 {p90:.0f}) -> lag {lag}; load average {load_before}", flush=True)
    chosen = arms(GRPOConfig(), full=scale is Scale.FULL)
    model_dir, runs, before = real_model_dir(), [], {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-offlong-") as tmp:
        for seed in sizes.seeds:
            base = long_config(Path(tmp), model_dir, sizes, seed)
            policy = load_policy(model_dir, lora=base.lora if base.lora.enabled else None, dtype=base.model.dtype)
            start: Any = tree_flatten(policy.model.trainable_parameters())
            before[seed] = held_out(TrainLoop.around(base, policy), seed)
            print(f"offpolicy_long seed {seed}: held-out reward before training {before[seed]:.3f}", flush=True)
            runs += [one_run(with_arm(base, arm), policy, start, arm, lag) for arm in chosen]
    context = (f"long-answers recipe, {sizes.groups} x G {sizes.group_size} a step, {sizes.steps} steps at lag {lag} "
               f"(simulator: {mean:.2f} behind, p90 {p90:.0f}); held-out {base.train.eval_mode} avg@"
               f"{sizes.eval_samples} on {sizes.eval_prompts} prompts; {time.perf_counter() - started:.0f} s; load "
               f"average {_load(load_before)} before, {_load(os.getloadavg())} after")
    _report(report, chosen, runs, before, lag, context)


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in avg)


def _median(runs: list[ArmRun], value: typing.Callable[[ArmRun], float]) -> float:
    return statistics.median(value(r) for r in runs)


def _report(report: Report, chosen: list[Arm], runs: list[ArmRun], before: dict[int, float], lag: int,
            context: str) -> None:
    by_arm = {arm.name: [r for r in runs if r.arm == arm.name] for arm in chosen}
    default = chosen[0].name
    start = statistics.median(before.values())
    for name, mine in by_arm.items():
        stale = OffPolicyStats.of([s for r in mine for k, s in r.steps if k == lag])
        tokens = [t for r in mine for t in r.reply_tokens]
        notes = (f"{context}; before {start:.3f}, after {[round(r.final, 3) for r in mine]}; replies "
                 f"{statistics.fmean(tokens):.0f} tokens mean ({sum(r.truncated for r in mine)}/{len(tokens)} cut off); "
                 f"at staleness {lag}: gap mean {stale.gap_mean:.4f} nats, max {stale.gap_max:.3g}, clip "
                 f"{stale.clip_fraction:.4f}, capped {stale.capped_fraction:.4f}; a step (median after the first): sampling "
                 f"{_median(mine, lambda r: statistics.median(r.sampling_seconds[1:] or r.sampling_seconds)):.1f} s, "
                 f"Trainer.step {_median(mine, lambda r: r.step_seconds):.1f} s, pi_ref "
                 f"{_median(mine, lambda r: r.ref_share):.0%} of it; KL to pi_ref at the end {_median(mine, lambda r: r.kl):.4g}")
        report.add(Figure("offpolicy_long", f"long answers at lag {lag}: held-out reward after "
                          f"{len(mine[0].steps)} steps, {name}",
                          _median(mine, lambda r: r.final), "reward", baseline=start,
                          baseline_name="before training", notes=notes))
    beta0 = next((a.name for a in chosen if a.grpo.get("beta") == 0 and a.name != default), None)
    if beta0 is None:
        return
    report.add(Figure("offpolicy_long", "long answers: Trainer.step seconds, beta 0 vs the default",
                      _median(by_arm[beta0], lambda r: r.step_seconds), "s",
                      baseline=_median(by_arm[default], lambda r: r.step_seconds), baseline_name="default s",
                      notes=f"pi_ref pass {_median(by_arm[default], lambda r: r.ref_share):.0%} of the default's "
                            f"step; {context}"))
    report.add(Figure("offpolicy_long", "long answers: KL(pi_theta || pi_ref) at the end, beta 0 vs the default",
                      _median(by_arm[beta0], lambda r: r.kl), "nats",
                      baseline=_median(by_arm[default], lambda r: r.kl), baseline_name="default nats",
                      notes=f"k3 on a batch sampled by the final weights, pi_ref the base (adapters off); {context}"))
