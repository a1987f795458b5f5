"""Benchmark `two_macs`: two cores as two Macs, at long completions.

One machine cannot show why a fleet exists unless each process gets what one Mac
would: here a core each, with one BLAS thread (`launch/local_fleet.py: pin`, OPENBLAS_NUM_THREADS=1).
On the same model (SmolLM2-135M-Instruct from the zoo), task, batch (B x G), LoRA
and learning rate, at completions of up to 256 tokens:

* mlx-lm-lora's GRPO trainer pinned to one core (one Mac), in its own venv
  (bench/mlx_lm_lora.py), sampling as grpo-fleet does (top_p 1, top_k 0) so that
  both write replies of the same lengths;
* the fleet: its learner pinned to core 0 and one actor to core 1 (two Macs).

Reported: the steady time per step of both (from step 1 to the last, so start-up
and the eval rounds at step 0 and at the end are outside it) and its ratio; and
the bound that the split of the work allows, (generation + training) /
max(generation, training), with the fleet's distance from it. Generation and
training are each core's busy seconds per step over the same window: the CPU
time of the pinned actor (decoding, scoring, loading weights) and of the pinned
learner (its step, checks, intake, publishing), read from /proc. The actor's
own per-lease histogram cannot be added up here: its rolling batch decodes the
next lease while the last one finishes, so the leases' durations overlap. The
learner's own step seconds (metrics.jsonl) are shown beside it.

Also: the time to the same held-out reward, when both reach one (eval at step 0
and after the last step, with the clock stopped, as bench `real` does). The
recipe samples at T = 0.7, where mlx-lm-lora's loss takes logprobs of
softmax(logits), not of the tempered distribution it sampled from
(bench/mlx_lm_lora.py lists every difference): its speed is comparable, its
learning less so.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.mlx_lm_lora import BaselineUnavailable
from grpo_fleet.bench.real import MODEL, RealCurve, fleet_run, target_reward
from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import DEMOS_DIR, DemoOptions, demo_config
from grpo_fleet.launch.local_fleet import Fleet
from grpo_fleet.observe.plotting import load_step_records

# The task: the packaged long-answer recipe when it is there; else demo.toml asked for long replies.
# Switching tasks is this one line (a variant name under grpo_fleet/demos/smollm2-135m-instruct/).
RECIPE = "long-answers"
LONG_REPLIES = [
    "generation.max_tokens=256",
    'task.system_prompt="Describe the capital city in a long paragraph: its name first, then its history, '
    'landmarks and people."',
    'task.rewards=["names_the_capital"]', "task.reward_weights=[1.0]",
]
LEARNER_CORE, ACTOR_CORE, BASELINE_CORE = 0, 1, 0
# One core takes about 75 s per 1,000 completion tokens of generation and training together (the smoke run's CPU
# seconds), so the sizes are small: QUICK (3 steps of 1 x 4) is a smoke test whose figures mean little, DEFAULT
# (4 steps of 2 x 4) about 14 minutes, FULL (8 steps of 2 x 8, the recipe's G) about 50. Both contenders run
# the same B x G; the steady window runs from step 1, so every scale has at least 3 steps.
STEPS = {Scale.QUICK: 3, Scale.DEFAULT: 4, Scale.FULL: 8}
BATCH = {Scale.QUICK: ["grpo.groups_per_step=1", "generation.group_size=4"],
         Scale.DEFAULT: ["grpo.groups_per_step=2", "generation.group_size=4"],
         Scale.FULL: ["grpo.groups_per_step=2", "generation.group_size=8"]}
# Held out: a few prompts, one sample each (eval leases decode alone, in small batches: minutes at 256 tokens).
EVAL_PROMPTS = {Scale.QUICK: 2, Scale.DEFAULT: 4, Scale.FULL: 16}
EVAL = ['train.eval_mode="sampled"', "train.eval_samples=1", "train.log_samples_every=0"]
GOAL_RATIO = "<= 0.6x"
GOAL_BOUND = ">= 0.85x (within 15%)"


def split_bound(generation: float, training: float) -> float:
    """The most a learner and an actor on two machines can speed up one machine doing both in turn:
    (generation + training) / max(generation, training) (2 when the two halves are equal)."""
    longest = max(generation, training)
    return (generation + training) / longest if longest > 0 else float("nan")


def cpu_seconds_from_stat(stat: str, ticks_per_second: int) -> float:
    """User + system CPU seconds of a process (all its threads, and its reaped children), from /proc/PID/stat.

    Fields are counted after the ")" that ends the command name, which may itself hold spaces.
    """
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])  # stat fields 14-17
    return (utime + stime + cutime + cstime) / ticks_per_second


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        return cpu_seconds_from_stat(handle.read(), os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class Mark:
    """The fleet when the learner's metrics.jsonl had `steps` step lines: a clock and each core's CPU seconds."""

    steps: int
    wall: float
    learner_cpu: float
    actor_cpu: float


def window_tokens(tokens: dict[int, float], first: int, last: int) -> float:
    """Completion tokens per step of the steps after `first`, up to `last`: the work of a steady window whose
    clock starts when step `first` has ended (NaN when the window is empty or a step is missing)."""
    steps = range(first + 1, last + 1)
    if not steps or any(step not in tokens for step in steps):
        return float("nan")
    return sum(tokens[step] for step in steps) / len(steps)


def per_step(first: Mark, last: Mark) -> tuple[float, float, float]:
    """(wall, learner CPU, actor CPU) seconds per step between two marks."""
    steps = last.steps - first.steps
    if steps <= 0:
        return float("nan"), float("nan"), float("nan")
    return ((last.wall - first.wall) / steps, (last.learner_cpu - first.learner_cpu) / steps,
            (last.actor_cpu - first.actor_cpu) / steps)


@dataclass
class Marks:
    """Watches a running fleet (real.fleet_run's on_poll): a Mark each time a step line appears."""

    metrics: Path
    seen: list[Mark] = field(default_factory=list)

    def __call__(self, fleet: Fleet) -> None:
        steps = len(load_step_records(self.metrics))
        if steps and (not self.seen or steps > self.seen[-1].steps):
            try:
                self.seen.append(Mark(steps, time.monotonic(), cpu_seconds(fleet.learner.proc.pid),
                                      cpu_seconds(fleet.actors[0].proc.pid)))
            except OSError:  # a process that has just exited: the window ends at the mark before
                pass

    def steady(self) -> tuple[float, float, float]:
        """Per step from the first step line to the last (start-up and the step-0 eval round before it)."""
        return per_step(self.seen[0], self.seen[-1]) if self.seen else (float("nan"),) * 3


def bench_config(run_dir: Path, scale: Scale, recipe: str = RECIPE) -> RunConfig:
    """The task (the recipe, or demo.toml asked for long replies) at this scale's steps and batch, eval at
    step 0 and after the last step only, so that no eval round falls inside the steady window."""
    packaged = (DEMOS_DIR / MODEL / f"{recipe}.toml").exists()
    steps = STEPS[scale]
    overrides = ([] if packaged else LONG_REPLIES) + BATCH.get(scale, []) + EVAL + [
        f"task.num_eval={EVAL_PROMPTS[scale]}", f"train.eval_every={steps}"]
    return demo_config(DemoOptions(model=MODEL, config=recipe if packaged else None, run_dir=str(run_dir),
                                   steps=steps, progress=False, overrides=overrides))


@dataclass(frozen=True)
class Baseline:
    """mlx-lm-lora's run: its held-out curve, and its steady seconds and completion tokens per step."""

    curve: RealCurve
    step_seconds: float
    tokens_per_step: float


def baseline_run(cfg: RunConfig, model_path: str, out_dir: Path) -> Baseline:
    """mlx-lm-lora on one core, sampling as the fleet does; steady step seconds from its progress log."""
    from grpo_fleet.bench.mlx_lm_lora import run_mlx_lm_lora, spec_from_config

    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
    points = run_mlx_lm_lora(spec_from_config(local, their_sampler=False), out_dir, base=local, cpu=BASELINE_CORE)
    curve = RealCurve("mlx-lm-lora", [(p.step, p.wall_seconds, p.reward) for p in points])
    records = [json.loads(line) for line in (out_dir / "progress.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in records if r["step"] >= 1]
    first, last = trained[0], trained[-1]
    seconds = (last["wall_seconds"] - first["wall_seconds"]) / max(last["step"] - first["step"], 1)
    batch = cfg.grpo.groups_per_step * cfg.generation.group_size
    tokens = {r["step"]: float(r["mean_tokens"]) * batch for r in trained if r.get("mean_tokens") is not None}
    return Baseline(curve, seconds, window_tokens(tokens, first["step"], last["step"]))


def fleet_window(metrics: Path, marks: Marks) -> tuple[float, float]:
    """The fleet's completion tokens per step over the steady window, and its learner's mean step seconds."""
    steps = load_step_records(metrics)
    if not steps or not marks.seen:
        return float("nan"), float("nan")
    tokens = {int(s["step"]): float(s["tokens"]) for s in steps}
    return (window_tokens(tokens, marks.seen[0].steps, marks.seen[-1].steps),
            sum(float(s["step_seconds"]) for s in steps) / len(steps))


def run(report: Report, scale: Scale) -> None:
    from grpo_fleet.learner.run.build import resolve_model_path
    from grpo_fleet.tasks import build_task

    if len(os.sched_getaffinity(0)) < 2:
        report.add(Figure("two_macs", "fleet vs mlx-lm-lora, a core each", float("nan"), "s/step",
                          notes="skipped: this process may use fewer than 2 cores"))
        return
    with tempfile.TemporaryDirectory(prefix="grpo-bench-two-macs-") as tmp:
        cfg = bench_config(Path(tmp) / "fleet", scale)
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        marks = Marks(Path(cfg.run_dir) / "metrics.jsonl")
        fleet = fleet_run(cfg, actors=1, cores=[LEARNER_CORE, ACTOR_CORE], on_poll=marks)
        lengths = fleet_window(marks.metrics, marks)
        try:
            baseline: Optional[Baseline] = baseline_run(bench_config(Path(tmp) / "lora", scale), model_path,
                                                        Path(tmp) / "lora")
        except BaselineUnavailable as exc:
            baseline = None
            report.add(Figure("two_macs", "mlx-lm-lora baseline", float("nan"), "", notes=f"skipped: {exc}"))
    report_figures(report, cfg, marks, fleet, lengths, baseline)


def report_figures(report: Report, cfg: RunConfig, marks: Marks, fleet: RealCurve, lengths: tuple[float, float],
                   baseline: Optional[Baseline]) -> None:
    wall, learner, actor = marks.steady()
    tokens, step_seconds = lengths
    batch = f"{cfg.grpo.groups_per_step} x {cfg.generation.group_size}, max_tokens {cfg.generation.max_tokens}"
    window = f"steps {marks.seen[0].steps}..{marks.seen[-1].steps}" if marks.seen else "no steps"
    lora_s = baseline.step_seconds if baseline else None
    lora_tokens = baseline.tokens_per_step if baseline else float("nan")
    report.add(Figure(
        "two_macs", "time per step, fleet (2 cores) vs mlx-lm-lora (1 core)", wall, "s/step", baseline=lora_s,
        baseline_name="mlx-lm-lora s/step", goal=GOAL_RATIO,
        notes=f"batch {batch}; fleet {window}; completion tokens per step: fleet {tokens:.0f}, mlx-lm-lora "
              f"{lora_tokens:.0f}; the fleet learner's own step {step_seconds:.1f} s on average",
    ))
    report.add(Figure(
        "two_macs", "time per 1,000 completion tokens, fleet vs mlx-lm-lora",
        1000 * wall / tokens if tokens > 0 else float("nan"), "s",
        baseline=1000 * lora_s / lora_tokens if lora_s and lora_tokens > 0 else None, baseline_name="mlx-lm-lora s",
        goal=GOAL_RATIO,
        notes="the same windows per token: sampled replies differ in length from step to step and between the two",
    ))
    bound = split_bound(actor, learner)
    speedup = lora_s / wall if lora_s else float("nan")
    report.add(Figure(
        "two_macs", "fleet speed-up vs the bound the split allows", speedup, "x", baseline=bound,
        baseline_name="(generation + training) / max", goal=GOAL_BOUND,
        notes=f"per step: actor core busy {actor:.1f} s (generation, scoring, weights), learner core busy "
              f"{learner:.1f} s (step, checks, intake), CPU time of each pinned process over the fleet's {window}",
    ))
    time_to_reward(report, fleet, baseline.curve if baseline else None)


def time_to_reward(report: Report, fleet: RealCurve, lora: Optional[RealCurve]) -> None:
    """Time to the same held-out reward: half-way from the higher start to the lower end, if both rose past it."""
    curves = [fleet] + ([lora] if lora else [])
    if not lora or not fleet.points or not lora.points:
        report.add(Figure("two_macs", "time to the same held-out reward", float("nan"), "s",
                          notes=f"no common target: curves {[c.points for c in curves]}"))
        return
    start = max(fleet.points[0][2], lora.points[0][2])
    end = min(fleet.points[-1][2], lora.points[-1][2])
    target = target_reward(start, end)
    reached = end > start
    fleet_s, lora_s = fleet.time_to(target), lora.time_to(target)
    report.add(Figure(
        "two_macs", f"time to held-out {target:.3f}, fleet vs mlx-lm-lora",
        fleet_s if reached and fleet_s is not None else float("nan"), "s",
        baseline=lora_s if reached else None, baseline_name="mlx-lm-lora s",
        notes=("" if reached else "not reached by both within the run: neither ended above the other's start; ")
        + f"curves (step, s without eval, reward): fleet {fleet.points}; mlx-lm-lora {lora.points}",
    ))
