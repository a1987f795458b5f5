"""Benchmark `real`: learning on a real pretrained model, the fleet against what a user would run instead.

The model is SmolLM2-135M-Instruct (the zoo's GGUF, imported once), the task and
every hyperparameter are `make demo-real`'s (grpo_fleet/demos/NAME/demo.toml):
same B x G, token budget, LoRA rank and learning rate for every contender.

* fleet: learner + 2 actor processes, as `make demo-real` runs them. Its held-out
  curve is the learner's own eval rounds; the clock starts before any process
  starts, and the time the rounds themselves take is taken off it.
* loop: the strongest single process this project can build, `TrainLoop`
  (batched shared-prefix generation, the same Trainer), evaluated with its clock
  stopped.

Every contender is scored the way the fleet's eval rounds score it (the
config's train.eval_mode: sampled avg@4 at T = 1 for demo-real), through
grpo_fleet.models.evaluate.
* mlx-lm-lora: its GRPO trainer in its own venv (bench/mlx_lm_lora.py).

Reported: time to a target held-out reward (the fleet's ratio to each
baseline), steps/s and completions/s, and the curves themselves.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop, batched_rollout
from grpo_fleet.bench.mlx_lm_lora import BaselineUnavailable
from grpo_fleet.bench.scraping import Scraped, scrape
from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import DemoOptions, demo_config
from grpo_fleet.launch.local_fleet import Fleet, running
from grpo_fleet.observe.plotting import load_eval_records, load_step_records

MODEL = "smollm2-135m-instruct"
# Rejections that accuse the sender of lying or of sending garbage: every actor in the fleet run is honest,
# so each of these is a false rejection.
ACCUSING = ("reward_mismatch", "logprob_mismatch", "invalid")
REJECTIONS = "grpo_fleet_learner_rejections_total"
GAP = "grpo_fleet_learner_logprob_gap_nats"
SCRAPE_EVERY_SECONDS = 1.0


@dataclass
class RealCurve:
    """One contender: held-out reward against steps and against seconds (eval time excluded)."""

    contender: str
    points: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, held-out reward)
    completions: int = 0
    seconds: float = 0.0
    learner_metrics: Optional[Scraped] = None  # the fleet learner's last /metrics page before it exited
    notes: str = ""

    def time_to(self, target: float) -> Optional[float]:
        return next((s for _, s, r in self.points if r >= target), None)

    def steps_to(self, target: float) -> Optional[int]:
        return next((step for step, _, r in self.points if r >= target), None)

    @property
    def completions_per_second(self) -> float:
        return self.completions / self.seconds if self.seconds > 0 else float("nan")

    def as_json(self) -> dict:
        return {"contender": self.contender, "points": self.points, "completions": self.completions,
                "seconds": self.seconds}


def real_config(run_dir: Path, *, steps: Optional[int] = None, seed: int = 0,
                overrides: Optional[list[str]] = None) -> RunConfig:
    """The demo-real config (zoo model, packaged task) with a run dir and an optional step budget."""
    cfg = demo_config(DemoOptions(model=MODEL, run_dir=str(run_dir), steps=steps, progress=False,
                                  overrides=list(overrides or []) + [f"train.seed={seed}"]))
    return cfg


def fleet_run(cfg: RunConfig, actors: int = 2, *, cores: Optional[Sequence[int]] = None,
              on_poll: Optional[Callable[[Fleet], None]] = None) -> RealCurve:
    """Run the fleet to cfg.train.steps; its eval rounds, each stamped when it appeared, less eval time so far.

    `cores` pins its processes (launch/local_fleet.py: start_fleet); `on_poll` sees the running fleet every poll.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "bench-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    metrics = run_dir / "metrics.jsonl"
    launched, seen, stamps, scraped_at = time.monotonic(), 0, [], 0.0
    page: Optional[Scraped] = None
    with running(cfg, config_path, actors, cores) as fleet:
        while fleet.learner.proc.poll() is None:
            if on_poll is not None:
                on_poll(fleet)
            rounds = load_eval_records(metrics)
            stamps += [time.monotonic() - launched] * (len(rounds) - seen)
            seen = len(rounds)
            if time.monotonic() - scraped_at >= SCRAPE_EVERY_SECONDS:
                page, scraped_at = scrape(cfg.metrics.port) or page, time.monotonic()
            time.sleep(0.25)
    rounds = load_eval_records(metrics)
    stamps += [time.monotonic() - launched] * (len(rounds) - len(stamps))
    curve, eval_seconds = RealCurve("fleet", learner_metrics=page), 0.0
    for stamp, record in zip(stamps, rounds):
        eval_seconds += float(record.get("seconds", 0.0))
        curve.points.append((int(record["step"]), max(stamp - eval_seconds, 0.0), float(record["eval_reward"])))
    steps = load_step_records(metrics)
    curve.completions = len(steps) * cfg.grpo.groups_per_step * cfg.generation.group_size
    if steps:
        mean_step = sum(float(s["step_seconds"]) for s in steps) / len(steps)
        mean_stale = sum(float(s["staleness_mean"]) for s in steps) / len(steps)
        curve.notes = (f"the learner's own step (training only, while {actors} actors generate on the same cores) took "
                       f"{mean_step:.1f} s on average; groups trained {mean_stale:.2f} versions stale on average")
    curve.seconds = curve.points[-1][1] if curve.points else 0.0
    return curve


def loop_run(cfg: RunConfig, model_path: str) -> RealCurve:
    """TrainLoop in this process: sample a batch, train, and evaluate every train.eval_every steps (clock stopped)."""
    launched, paused = time.monotonic(), 0.0
    loop = TrainLoop.build(cfg, model_path)
    curve = RealCurve("loop")

    def evaluate(step: int) -> None:
        nonlocal paused
        started = time.monotonic()
        reward = loop.held_out()
        curve.points.append((step, started - launched - paused, reward))
        paused += time.monotonic() - started

    evaluate(0)
    every = cfg.train.eval_every or cfg.train.steps
    for step in range(1, cfg.train.steps + 1):
        loop.train(loop.batch(loop.policy, batched_rollout))
        curve.completions += cfg.grpo.groups_per_step * cfg.generation.group_size
        if step % every == 0 or step == cfg.train.steps:
            evaluate(step)
    curve.seconds = curve.points[-1][1]
    return curve


def lora_baseline_run(cfg: RunConfig, model_path: str, out_dir: Path) -> RealCurve:
    """mlx-lm-lora's GRPO trainer on the same config (its own venv; snapshots evaluated by our evaluate)."""
    from grpo_fleet.bench.mlx_lm_lora import run_mlx_lm_lora, spec_from_config

    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
    points = run_mlx_lm_lora(spec_from_config(local), out_dir, base=local)
    curve = RealCurve("mlx-lm-lora", [(p.step, p.wall_seconds, p.reward) for p in points])
    curve.completions, curve.seconds = points[-1].completions, points[-1].wall_seconds
    return curve


def _time_figure(report: Report, fleet: RealCurve, other: RealCurve, target: float, goal: Optional[str]) -> None:
    fleet_s, other_s = fleet.time_to(target), other.time_to(target)
    report.add(Figure(
        "real", f"time to held-out {target:.3f}, fleet vs {other.contender}", fleet_s if fleet_s is not None else float("nan"),
        "s", baseline=other_s, baseline_name=f"{other.contender} s", goal=goal,
        notes=f"steps to target: fleet {fleet.steps_to(target)}, {other.contender} {other.steps_to(target)}; "
              f"curves (step, s, reward): fleet {_rounded(fleet)}; {other.contender} {_rounded(other)}",
    ))
    report.add(Figure(
        "real", f"completions/s, fleet vs {other.contender}", fleet.completions_per_second, "completions/s",
        baseline=other.completions_per_second, baseline_name=f"{other.contender} completions/s",
        notes=f"fleet {fleet.completions} completions in {fleet.seconds:.0f} s, {other.contender} {other.completions} in "
              f"{other.seconds:.0f} s (eval time excluded); {fleet.notes}",
    ))


def verification_figure(report: Report, page: Optional[Scraped]) -> None:
    """False rejections over the fleet run (all its actors are honest) and the logprob checks' gaps."""
    if page is None:
        report.add(Figure("real", "fleet: honest submissions falsely rejected", float("nan"), "rejections",
                          goal="0", notes="the learner's /metrics never answered"))
        return
    reasons = {reason: int(value) for reason, value in page.by_label(REJECTIONS, "reason").items() if value}
    checks = page.value(f"{GAP}_count")
    buckets = sorted((float(le), value) for le, value in page.by_label(f"{GAP}_bucket", "le").items())
    under = next((le for le, value in buckets if value >= checks), float("inf")) if checks else float("nan")
    mean = page.value(f"{GAP}_sum") / checks if checks else float("nan")
    report.add(Figure(
        "real", "fleet: honest submissions falsely rejected", sum(reasons.get(r, 0) for r in ACCUSING), "rejections",
        goal="0", notes=f"every rejection by reason: {reasons or 'none'}; {int(checks)} logprob checks, mean honest gap "
                        f"{mean:.3g} nats, every one <= {under:g} (histogram bucket)",
    ))


def _rounded(curve: RealCurve) -> list[tuple[int, float, float]]:
    return [(step, round(seconds, 1), round(reward, 3)) for step, seconds, reward in curve.points]


def target_reward(before: float, after: float) -> float:
    """Half-way from the base model's held-out reward to where the fleet ended: a level every contender
    that learns at all can reach within the budget, and one that says how fast each gets there."""
    return before + 0.5 * max(after - before, 0.0)


def run(report: Report, scale: Scale) -> None:
    from grpo_fleet.learner.run.build import resolve_model_path
    from grpo_fleet.tasks import build_task

    with tempfile.TemporaryDirectory(prefix="grpo-bench-real-") as tmp:
        steps = 4 if scale is Scale.QUICK else None
        cfg = real_config(Path(tmp) / "fleet", steps=steps)
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        fleet = fleet_run(cfg)
        loop = loop_run(real_config(Path(tmp) / "loop", steps=steps), model_path)
        curves = [fleet, loop]
        try:
            curves.append(lora_baseline_run(real_config(Path(tmp) / "lora", steps=steps), model_path, Path(tmp) / "lora"))
        except BaselineUnavailable as exc:
            report.add(Figure("real", "mlx-lm-lora baseline", float("nan"), "", notes=f"skipped: {exc}"))
        Path("bench").mkdir(exist_ok=True)
        (Path("bench") / "real_curves.json").write_text(json.dumps([c.as_json() for c in curves], indent=2))
    before, after = fleet.points[0][2], fleet.points[-1][2]
    target = target_reward(before, after)
    report.add(Figure("real", "fleet held-out reward, start -> end", after, "reward", baseline=before,
                      baseline_name="step 0", goal="a rise >= 0.2",
                      notes=f"{fleet.points[-1][0]} steps, {fleet.seconds:.0f} s (eval time excluded)"))
    verification_figure(report, fleet.learner_metrics)
    _time_figure(report, fleet, loop, target, goal=None)
    for baseline in curves[2:]:
        _time_figure(report, fleet, baseline, target, goal="<= 1.0x")
