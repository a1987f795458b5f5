"""Benchmark: the fleet simulator against real fleets here, then what it says about Macs.

Check: the real model (SmolLM2-135M, the demo-real task at 2 groups x 4 a
step) trained by a learner and 1, then 2 actors on this machine. Here every
process shares two cores, so the speeds a run shows are partly each other's
contention. The simulator is given what each process does alone, measured
right after the run in a process with the run's own environment
(`bench.alone`: the actor's seconds per group, the learner's step and the
check's forward of one group, and the cores each keeps busy) and this host's
cores (`simulator.SharedHost`), plus what is the task's, not the machine's: the
share of informative groups and the weight-fetch time the run saw. It
simulates as many steps as the run had, the probation of each new actor
included, and its steps/s is compared with the run's (steps after the first,
by wall clock). For contrast it is also given the run's own contended speeds
as if each process had a machine to itself, which is what it would be told on
a fleet of Macs. The cores other work took are averaged over the whole run,
start-up and the final eval included; the notes also give them, and the fleet's
own, over the measured steps alone, and what the simulator says given those.

Plan: 1-64 simulated actors at published Apple-silicon decode speeds
(simulator.published) feeding 1, 2 and 4 learner ranks, with the check's share
of a step measured in the same run, and how the actor count that saturates one
learner moves with the learner's speed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.alone import AloneSpeeds, measure_alone_as_fleet
from grpo_fleet.bench.host_share import HostShare
from grpo_fleet.bench.real import real_config
from grpo_fleet.bench.scraping import Scraped, scrape
from grpo_fleet.config import RunConfig
from grpo_fleet.launch.local_fleet import running
from grpo_fleet.observe.plotting import load_step_records
from grpo_fleet.simulator.plan import Plan, PlanInputs, PlanShape, plan, render
from grpo_fleet.simulator.published import LOGPROB_CHECK_SHARE
from grpo_fleet.simulator.simulation import simulate
from grpo_fleet.simulator.specs import ActorSpec, CheckSpec, FleetRules, RunSpec, SharedHost

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
    answer_seconds_per_group: float
    logprob_check_seconds: float  # the check's seconds a step (metrics.jsonl check_seconds), mean over steps
    lease_groups: float  # mean groups per lease
    steps: int  # step lines in metrics.jsonl
    load_average: float  # the host's, over the run (other work on a shared host slows every process alike)
    other_cores: float  # cores the rest of the host kept busy over the run (bench.host_share)
    # The same, and the fleet's own cores, over the measured steps only (from step 1's line to the run's end; None
    # for a run too short to sample): a diagnostic beside the figure, which other_cores feeds.
    steps_other_cores: Optional[float] = None
    steps_fleet_cores: Optional[float] = None


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
        loads: list[float] = []  # the host's 1-minute load average, the run's own processes included
        share = HostShare([fleet.learner.proc.pid] + [actor.proc.pid for actor in fleet.actors])
        steps_from: Optional[int] = None  # the first sample once step 1 ended, where steps/s is measured from
        while fleet.learner.proc.poll() is None:
            pages = [scrape(port) or page for port, page in zip(fleet.actor_ports, pages)]
            learner_page = scrape(cfg.metrics.port) or learner_page
            loads.append(os.getloadavg()[0])
            share.sample()
            if steps_from is None and share.samples and len(load_step_records(run_dir / "metrics.jsonl")) >= 2:
                steps_from = len(share.samples) - 1
            time.sleep(1.0)
    every = load_step_records(run_dir / "metrics.jsonl")
    steps = every[1:]  # the first step carries start-up and warm-up
    walls = [float(s["wall_seconds"]) for s in steps]
    groups, per_group, fetch = _actor_figures([p for p in pages if p is not None])
    learner = learner_page.value if learner_page is not None else (lambda name: 0.0)
    return MeasuredRun(
        actors=actors,
        steps_per_second=(len(walls) - 1) / (walls[-1] - walls[0]),
        seconds_per_group=per_group, fetch_seconds=fetch,
        step_seconds=sum(float(s["step_seconds"]) for s in steps) / len(steps),
        # Over the whole run, from the counters: a mean of each step's share weighs a step of few groups as one
        # of many (metrics.jsonl's zero_variance_fraction is the share since the step before).
        informative_fraction=1.0 - learner(f"{LEARNER}_groups_zero_variance_total")
        / max(learner(f"{LEARNER}_groups_accepted_total"), 1.0),
        answer_seconds_per_group=learner(f"{LEARNER}_rollouts_answer_seconds_sum") / max(groups, 1.0),
        logprob_check_seconds=sum(float(s.get("check_seconds") or 0.0) for s in steps) / len(steps),
        lease_groups=learner(f"{LEARNER}_lease_groups_sum") / max(learner(f"{LEARNER}_lease_groups_count"), 1.0),
        steps=len(every), load_average=sum(loads) / max(1, len(loads)), other_cores=share.other_cores(),
        steps_other_cores=_over_steps(share, steps_from, share.other_cores),
        steps_fleet_cores=_over_steps(share, steps_from, share.fleet_cores),
    )


def _over_steps(share: HostShare, since: Optional[int], cores: Callable[[int], float]) -> Optional[float]:
    """`cores` from sample `since` on, or None when fewer than two samples lie there."""
    return cores(since) if since is not None and len(share.samples) - since >= 2 else None


def _run_spec(cfg: RunConfig, run: MeasuredRun, step_seconds: float, forward_seconds: float) -> RunSpec:
    """The run as the simulator takes it: as many steps, measured from the second (as the run is)."""
    return RunSpec(rules=FleetRules.from_config(cfg), step_seconds=step_seconds,
                   informative_fraction=run.informative_fraction, answer_seconds_per_group=run.answer_seconds_per_group,
                   check=CheckSpec.from_config(cfg, forward_seconds), steps=run.steps, measure_from=1)


def predicted_own_machines(run: MeasuredRun, cfg: RunConfig, alone: AloneSpeeds) -> float:
    """Steps/s from the run's own (contended) speeds, as if each process had a machine to itself (the check's
    forward scaled from alone by the step's contention)."""
    actor = ActorSpec(run.seconds_per_group, run.fetch_seconds, max_groups=cfg.server.max_groups_per_lease)
    forward = alone.logprob_check.seconds * run.step_seconds / alone.step.seconds
    return simulate([actor] * run.actors, _run_spec(cfg, run, run.step_seconds, forward)).steps_per_second


def predicted_shared_host(run: MeasuredRun, cfg: RunConfig, alone: AloneSpeeds, cores: Optional[float] = None) -> float:
    """Steps/s from each process's alone-speed, all sharing the cores of this host that other work left them
    (`cores`; by default fleet_cores over the run)."""
    group, step, forward = alone.group.unstarved(), alone.step.unstarved(), alone.logprob_check.unstarved()
    host = SharedHost(cores=fleet_cores(run) if cores is None else cores, learner_cores=step.cores,
                      actor_cores=group.cores)
    actor = ActorSpec(group.seconds, run.fetch_seconds, max_groups=cfg.server.max_groups_per_lease,
                      lease_seconds=alone.lease.unstarved().seconds)
    spec = _run_spec(cfg, run, step.seconds, forward.seconds)
    return simulate([actor] * run.actors, spec, host).steps_per_second


def fleet_cores(run: MeasuredRun) -> float:
    """This host's cores less those other work kept busy during the run (a quarter core at least)."""
    return _left(run.other_cores)


def _left(other_cores: float) -> float:
    return max(0.25, float(os.cpu_count() or 1) - other_cores)


def _over_steps_note(run: MeasuredRun, cfg: RunConfig, alone: AloneSpeeds) -> str:
    """Other work's and the fleet's own cores over the measured steps only, and what the simulator says given those
    (a diagnostic: the figure's cores are over the whole run, start-up included)."""
    if run.steps_other_cores is None or run.steps_fleet_cores is None:
        return ""
    cores = _left(run.steps_other_cores)
    simulated = predicted_shared_host(run, cfg, alone, cores)
    return (f"; over the measured steps alone other work kept {run.steps_other_cores:.2f} cores busy and the fleet "
            f"{run.steps_fleet_cores:.2f}: given {cores:.2f} cores, simulated {simulated:.4f} "
            f"({simulated / run.steps_per_second:.3f}x)")


def check_share(cfg: RunConfig, alone: AloneSpeeds) -> float:
    """The check's forward of one group over that group's part of a step, as measured alone."""
    return alone.logprob_check.unstarved().seconds / (alone.step.unstarved().seconds / cfg.grpo.groups_per_step)


def check(report: Report, steps: int) -> list[float]:
    """Each fleet against the simulator; returns the check's share of a step measured alone in each run."""
    shares = []
    for actors in (1, 2):
        with tempfile.TemporaryDirectory(prefix="grpo-fleet-sim-") as tmp:
            cfg = real_config(Path(tmp) / "run", steps=steps, overrides=SHAPE)
            measured = measure_fleet(cfg, actors)
            alone = measure_alone_as_fleet(cfg)
        shares.append(check_share(cfg, alone))
        _report_check(report, cfg, measured, alone)
    return shares


def _report_check(report: Report, cfg: RunConfig, measured: MeasuredRun, alone: AloneSpeeds) -> None:
    shared, own = predicted_shared_host(measured, cfg, alone), predicted_own_machines(measured, cfg, alone)
    group, step, forward = alone.group.unstarved(), alone.step.unstarved(), alone.logprob_check.unstarved()
    label = f"{measured.actors} actor{'s' if measured.actors > 1 else ''}"
    report.add(Figure(
        "fleet_sim", f"simulated vs measured steps/s, real model, {label}, shared host",
        shared, "steps/s", baseline=measured.steps_per_second, baseline_name="measured",
        goal=f"within {GOAL:.0%}",
        notes=f"measured {measured.steps_per_second:.4f} steps/s over {measured.steps} steps, simulated {shared:.4f} "
        f"({shared / measured.steps_per_second - 1:+.1%}) from each process alone, one BLAS thread each as in the "
        f"run: a lease {alone.lease.unstarved().seconds:.2f} s + {group.seconds:.2f} s a group ({group.cores:.2f} "
        f"cores; the run's leases {measured.lease_groups:.1f} groups on average), step "
        f"{step.seconds:.2f} s ({step.cores:.2f} cores), the check's forward {forward.seconds:.2f} s a group "
        f"({check_share(cfg, alone):.2f} of a group's step), on {fleet_cores(measured):.2f} of the host's "
        f"{os.cpu_count()} cores (other work kept {measured.other_cores:.2f} busy; load average "
        f"{measured.load_average:.1f}); {measured.informative_fraction:.0%} informative, fetch "
        f"{measured.fetch_seconds:.2f} s" + _over_steps_note(measured, cfg, alone),
    ))
    report.add(Figure(
        "fleet_sim", f"simulated vs measured steps/s, real model, {label}, as if on machines of their own",
        own, "steps/s", baseline=measured.steps_per_second, baseline_name="measured",
        notes=f"simulated {own:.4f} ({own / measured.steps_per_second - 1:+.1%}) from the run's contended "
        f"speeds: {measured.seconds_per_group:.2f} s a group, step {measured.step_seconds:.2f} s, check "
        f"{measured.logprob_check_seconds:.2f} s a step, answers {measured.answer_seconds_per_group:.3f} s a group: "
        "what ignoring the shared cores costs",
    ))


def plans(report: Report, forward_share: float) -> None:
    """The planning tables (M5 Max actors for 0.5B and 7B), verification on against off at 8 actors and 4
    ranks, and the saturation point by learner speed; the check's forward share as measured in this run."""
    shape = PlanShape()
    for model in ("qwen2.5-0.5b", "qwen2.5-7b"):
        inputs = PlanInputs(model=model, mac="m5-max", check_forward_share=forward_share)
        result = plan(inputs, shape, PLAN_ACTORS, PLAN_RANKS)
        print(render(result, inputs, shape), flush=True)
        report.add(Figure(
            "fleet_sim", f"steps/h, {model}, M5 Max actors, learner at this VM's measured speed",
            3600 * max(x.steps_per_second for x in result.rows if x.ranks == 1), "steps/h", notes="; ".join(
                f"{r} rank{'s' if r > 1 else ''}: step {result.step_seconds[r]:.0f} s, saturated by "
                f"{result.saturating_actors[r]} actor(s)" for r in PLAN_RANKS)
            + (" (learner extrapolated by parameter count)" if result.learner_extrapolated else ""),
        ))
    on_over_off(report, forward_share)
    for tok_s in (20.0, 200.0, 2000.0, 20000.0):
        inputs = PlanInputs(model="qwen2.5-0.5b", mac="m5-max", learner_tok_s=tok_s, check_forward_share=forward_share)
        result = plan(inputs, shape, PLAN_ACTORS, PLAN_RANKS)
        report.add(Figure(
            "fleet_sim", f"M5 Max actors that saturate a {tok_s:g} tok/s learner, Qwen2.5-0.5B",
            float(result.saturating_actors[1]), "actors", notes=_saturation_notes(result),
        ))


def on_over_off(report: Report, forward_share: float) -> None:
    """Issue 26's planning goal: Qwen2.5-0.5B at 2,000 tok/s, 8 M5 Max actors, 4 ranks, the check on against off."""
    on = PlanInputs(learner_tok_s=2000.0, check_forward_share=forward_share)
    checked = plan(on, PlanShape(), [8], [4]).rows[0]
    trusted = plan(PlanInputs(learner_tok_s=2000.0, logprob_check=False), PlanShape(), [8], [4]).rows[0]
    report.add(Figure(
        "fleet_sim", "plan, Qwen2.5-0.5B at 2,000 tok/s, 8 actors, 4 ranks: steps/h, verification on",
        3600 * checked.steps_per_second, "steps/h", baseline=3600 * trusted.steps_per_second,
        baseline_name="verification off", goal=">= 0.85x",
        notes=f"{checked.forward_fraction:.0%} of trained groups recomputed at an older version, "
        f"{checked.check_seconds_per_step:.2f} s a step on the slowest rank; check forward share {forward_share:.2f}",
    ))


def _saturation_notes(result: Plan) -> str:
    return "; ".join(f"{r} rank{'s' if r > 1 else ''}: {result.saturating_actors[r]} actors, "
                     f"{3600 * max(x.steps_per_second for x in result.rows if x.ranks == r):.1f} steps/h"
                     for r in PLAN_RANKS)


def run(report: Report, scale: Scale) -> None:
    shares = check(report, steps=4 if scale is Scale.QUICK else 10)
    share = sum(shares) / len(shares)
    report.add(Figure("fleet_sim", "the check's forward of one group over its part of a one-rank step", share, "x",
                      baseline=LOGPROB_CHECK_SHARE, baseline_name="simulator.published",
                      notes="measured alone after each run (one BLAS thread): " + ", ".join(f"{x:.2f}" for x in shares)))
    plans(report, share)
