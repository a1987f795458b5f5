"""Benchmark: the fleet simulator against real fleets here, then what it says about Macs.

Check: the real model (SmolLM2-135M, the demo-real task at 2 groups x 4 a
step) trained by a learner and 1, then 2 actors on this machine. Each run's
own measurements feed the simulator: the actors' seconds per group and weight
fetch time (their /metrics), the learner's step time and the informative
share of groups (metrics.jsonl). The simulator's steady-state steps/s is then
compared with the run's (steps after the first, by wall clock). Here all
processes share two cores, so these inputs already carry that contention.

Plan: 1-64 simulated actors at published Apple-silicon decode speeds
(fleetsim.published) feeding 1, 2 and 4 learner ranks, and how the actor
count that saturates one learner moves with the learner's speed.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.real import real_config
from grpo_fleet.bench.scraping import Scraped, scrape
from grpo_fleet.config import RunConfig
from grpo_fleet.fleetsim.plan import Plan, PlanInputs, PlanShape, plan, render
from grpo_fleet.fleetsim.simulation import ActorSpec, RunSpec, simulate
from grpo_fleet.local_fleet import running
from grpo_fleet.plotting import load_step_records

ACTOR = "grpo_fleet_actor"
LEARNER = "grpo_fleet_learner"
SHAPE = ["grpo.groups_per_step=2", "generation.group_size=4", "train.eval_every=1000", "task.num_eval=2"]
PLAN_ACTORS = [1, 2, 4, 8, 16, 32, 64]
PLAN_RANKS = [1, 2, 4]
GOAL = 0.20  # the simulator within 20% of the measured steps/s


@dataclass(frozen=True)
class MeasuredRun:
    actors: int
    steps_per_second: float
    seconds_per_group: float
    fetch_seconds: float
    step_seconds: float
    informative_fraction: float
    check_seconds_per_group: float


def _actor_figures(pages: list[Scraped]) -> tuple[float, float, float]:
    """(groups generated, generation seconds per group, mean weight-fetch seconds) over every actor's last
    /metrics page."""
    seconds = sum(p.value(f"{ACTOR}_generation_duration_seconds_sum") for p in pages)
    groups = sum(p.value(f"{ACTOR}_groups_generated_total") for p in pages)
    fetch_sum = sum(p.value(f"{ACTOR}_weight_fetch_seconds_sum") for p in pages)
    fetches = sum(p.value(f"{ACTOR}_weight_fetch_seconds_count") for p in pages)
    return groups, seconds / max(groups, 1.0), fetch_sum / fetches if fetches else 0.0


def measure_fleet(cfg: RunConfig, actors: int) -> MeasuredRun:
    """Run the fleet to the end, scraping each actor's /metrics as it goes (they exit with the run)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "bench-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    with running(cfg, config_path, actors) as fleet:
        pages: list[Optional[Scraped]] = [None] * actors
        learner_page: Optional[Scraped] = None
        while fleet.learner.proc.poll() is None:
            pages = [scrape(port) or page for port, page in zip(fleet.actor_ports, pages)]
            learner_page = scrape(cfg.metrics.port) or learner_page
            time.sleep(1.0)
    steps = load_step_records(run_dir / "metrics.jsonl")[1:]  # the first step carries start-up and warm-up
    walls = [float(s["wall_seconds"]) for s in steps]
    groups, per_group, fetch = _actor_figures([p for p in pages if p is not None])
    answering = learner_page.value(f"{LEARNER}_rollouts_answer_seconds_sum") if learner_page is not None else 0.0
    return MeasuredRun(
        actors=actors,
        steps_per_second=(len(walls) - 1) / (walls[-1] - walls[0]),
        seconds_per_group=per_group, fetch_seconds=fetch,
        step_seconds=sum(float(s["step_seconds"]) for s in steps) / len(steps),
        informative_fraction=1.0 - sum(float(s["zero_variance_fraction"]) for s in steps) / len(steps),
        check_seconds_per_group=answering / max(groups, 1.0),
    )


def predicted(run: MeasuredRun, cfg: RunConfig) -> float:
    """The simulator's steady-state steps/s from the run's own measured inputs."""
    actor = ActorSpec(run.seconds_per_group, run.fetch_seconds, max_groups=cfg.server.max_groups_per_lease)
    spec = RunSpec(groups_per_step=cfg.grpo.groups_per_step, step_seconds=run.step_seconds,
                   informative_fraction=run.informative_fraction, max_staleness=cfg.grpo.max_staleness,
                   in_flight_steps=cfg.server.in_flight_steps, max_groups_per_lease=cfg.server.max_groups_per_lease,
                   lease_seconds=cfg.server.lease_seconds, check_seconds_per_group=run.check_seconds_per_group)
    return simulate([actor] * run.actors, spec).steps_per_second


def check(report: Report, steps: int) -> None:
    for actors in (1, 2):
        with tempfile.TemporaryDirectory(prefix="grpo-fleet-sim-") as tmp:
            cfg = real_config(Path(tmp) / "run", steps=steps, overrides=SHAPE)
            measured = measure_fleet(cfg, actors)
            model = predicted(measured, cfg)
        error = model / measured.steps_per_second - 1.0
        report.add(Figure(
            "fleet_sim", f"simulated vs measured steps/s, real model, {actors} actor{'s' if actors > 1 else ''}",
            model, "steps/s", baseline=measured.steps_per_second, baseline_name="measured",
            goal=f"within {GOAL:.0%}",
            notes=f"measured {measured.steps_per_second:.4f} steps/s, simulated {model:.4f} ({error:+.1%}) from the "
            f"run's own inputs: {measured.seconds_per_group:.2f} s a group, fetch {measured.fetch_seconds:.2f} s, "
            f"step {measured.step_seconds:.2f} s, checks {measured.check_seconds_per_group:.2f} s a group, "
            f"{measured.informative_fraction:.0%} informative",
        ))


def plans(report: Report) -> None:
    """The planning tables: M5 Max actors for 0.5B and 7B, and the saturation point by learner speed."""
    shape = PlanShape()
    for model in ("qwen2.5-0.5b", "qwen2.5-7b"):
        inputs = PlanInputs(model=model, mac="m5-max")
        result = plan(inputs, shape, PLAN_ACTORS, PLAN_RANKS)
        print(render(result, inputs, shape), flush=True)
        report.add(Figure(
            "fleet_sim", f"steps/h, {model}, M5 Max actors, learner at this VM's measured speed",
            3600 * max(x.steps_per_second for x in result.rows if x.ranks == 1), "steps/h", notes="; ".join(
                f"{r} rank{'s' if r > 1 else ''}: step {result.step_seconds[r]:.0f} s, saturated by "
                f"{result.saturating_actors[r]} actor(s)" for r in PLAN_RANKS)
            + (" (learner extrapolated by parameter count)" if result.learner_extrapolated else ""),
        ))
    for tok_s in (20.0, 200.0, 2000.0, 20000.0):
        inputs = PlanInputs(model="qwen2.5-0.5b", mac="m5-max", learner_tok_s=tok_s)
        result = plan(inputs, shape, PLAN_ACTORS, PLAN_RANKS)
        report.add(Figure(
            "fleet_sim", f"M5 Max actors that saturate a {tok_s:g} tok/s learner, Qwen2.5-0.5B",
            float(result.saturating_actors[1]), "actors", notes=_saturation_notes(result),
        ))


def _saturation_notes(result: Plan) -> str:
    return "; ".join(f"{r} rank{'s' if r > 1 else ''}: {result.saturating_actors[r]} actors, "
                     f"{3600 * max(x.steps_per_second for x in result.rows if x.ranks == r):.1f} steps/h"
                     for r in PLAN_RANKS)


def run(report: Report, scale: Scale) -> None:
    plans(report)
    check(report, steps=4 if scale is Scale.QUICK else 10)
