"""Benchmarks 2 and 6: how fast a real learner process takes rollouts in.

A real `grpo-fleet learner` process (tiny model, configured never to train) is
fed by simulated actors: separate spawned processes that speak the wire
protocol through `protocol.client` and send pre-built, valid completions. What is
measured is everything between the actor's socket and the learner's buffer:
framing, msgpack, pydantic validation, `validate_rollouts`, lease bookkeeping
and the ledger. Figures:

* accepted tokens/s and p50/p99 ack latency for 1, 8, 32, 64 actors;
* the learner's ingest time for one batch next to one `Trainer.step`;
* CURVE vs plain on the same rollout path (benchmark 6);
* the worst-case loop stall one hostile message causes (`bench/hostile.py`).

On a small machine the actors (and anything else running) share the CPUs with
the learner, so wall-clock tok/s moves with the load. Each phase therefore also
reports tokens per learner CPU-second (from /proc, where there is one): what a
dedicated learner core would take, and the steadier number to compare. A
learner at ~1 core busy is the limit; well under 1 core, the CPUs are.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.learner_process import (
    GROUP_SIZE,
    MAX_TOKENS,
    START_TIMEOUT_S,
    LearnerProcess,
    curve_for,
    start_learner,
    stop_learner,
    wait_serving,
)
from grpo_fleet.bench.simulated_actor import (
    GROUPS_PER_LEASE,
    REQUEST_TIMEOUT_S,
    completion_arrays,
    pool_worker,
)

# A real run's batch (GRPOConfig's default) for the plumbing-vs-step comparison.
STEP_GROUPS = 8
GOAL_TOKENS = ">= 1M tok/s at 32 actors"
# Benchmark 6 compares plain and CURVE at this actor count, in alternating windows.
CURVE_ACTORS = 8
CURVE_TURNS = 2


@dataclass
class Plan:
    """How long and with how many actors; quick runs are a subset."""

    actor_counts: list[int]
    warmup_s: float
    duration_s: float
    step_repeats: int


def _plan(scale: Scale) -> Plan:
    if scale is Scale.QUICK:
        return Plan(actor_counts=[1, 8], warmup_s=1.0, duration_s=2.0, step_repeats=2)
    if scale is Scale.DEFAULT:  # the goal's 32 actors; 64 only in the full run
        return Plan(actor_counts=[1, 8, 32], warmup_s=1.5, duration_s=5.0, step_repeats=3)
    return Plan(actor_counts=[1, 8, 32, 64], warmup_s=1.5, duration_s=5.0, step_repeats=3)


@dataclass
class Ingest:
    """What one or more measurement windows saw, summed over their actors."""

    actors: int
    seconds: float = 0.0
    tokens: int = 0
    groups: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    lease_ms: list[float] = field(default_factory=list)  # LeaseRequest -> Lease, for the notes
    rejected: int = 0
    empty_leases: int = 0
    errors: list[str] = field(default_factory=list)
    learner_cpu_s: Optional[float] = 0.0  # None once any window could not read /proc

    def add(self, out: dict) -> None:
        """Fold in one simulated actor's counts."""
        self.tokens += out["tokens"]
        self.groups += out["groups"]
        self.latencies_ms += out["latencies_ms"]
        self.lease_ms += out["lease_ms"]
        self.rejected += out["rejected"]
        self.empty_leases += out["empty_leases"]
        self.errors += out["errors"]

    def merge(self, other: "Ingest") -> None:
        """Fold in another window with the same actor count (alternating runs)."""
        self.add(vars(other))
        self.seconds += other.seconds
        if self.learner_cpu_s is None or other.learner_cpu_s is None:
            self.learner_cpu_s = None
        else:
            self.learner_cpu_s += other.learner_cpu_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def learner_cores(self) -> Optional[float]:
        return self.learner_cpu_s / self.seconds if self.learner_cpu_s is not None else None

    @property
    def tokens_per_learner_cpu_s(self) -> float:
        """Tokens per learner CPU-second: steadier than tok/s when other work shares the CPUs."""
        return self.tokens / self.learner_cpu_s if self.learner_cpu_s else float("nan")

    def latency(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


def _cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU of a process (Linux /proc); None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the pool and one measured phase


class ActorPool:
    """Spawned actor processes, started once and reused by every phase (spawning is the slow part)."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited sockets, threads or MLX
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=pool_worker, args=(self.commands, self.results), daemon=True) for _ in range(size)]
        try:
            for proc in self.procs:
                proc.start()
            for _ in self.procs:
                self.get(timeout=START_TIMEOUT_S)  # each says "ready" once its imports are done
        except BaseException:
            self.close()  # the caller never gets a pool to close
            raise

    def get(self, timeout: float) -> dict:
        """The next result; fails fast when a worker has died instead of waiting out the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"simulated actors: no result ({len(dead)} workers exited: {dead[:4]})") from None

    def close(self) -> None:
        for _ in self.procs:
            self.commands.put(None)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            if proc.pid is None:
                continue  # never started
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def _measure(pool: ActorPool, learner: LearnerProcess, actors: int, plan: Plan, label: str) -> Ingest:
    """Run `actors` simulated actors against `learner`; only the window after warm-up counts."""
    start = time.time() + plan.warmup_s
    end = start + plan.duration_s
    jobs = [
        {"endpoint": learner.endpoint, "identity": f"{label}-{actors}-{i}", "curve": curve_for(learner, i),
         "start": start, "end": end}
        for i in range(actors)
    ]
    for job in jobs:  # out now; the window opens after the warm-up
        pool.commands.put(job)
    time.sleep(max(0.0, start - time.time()))
    cpu0 = _cpu_seconds(learner.proc.pid)
    time.sleep(max(0.0, end - time.time()))
    cpu1 = _cpu_seconds(learner.proc.pid)
    wait = 2 * REQUEST_TIMEOUT_S + 10
    result = Ingest(actors=actors, seconds=plan.duration_s)
    for _ in jobs:
        result.add(pool.get(timeout=wait))
    result.learner_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    if result.errors or not result.tokens:
        raise RuntimeError(f"{label} with {actors} actors failed: {result.errors[:3]}; {learner.log_path.read_text()[-1500:]}")
    return result


# ---------------------------------------------------------------- one learner step, in-process


def _step_groups(prompts: list[np.ndarray], vocab: int) -> list:
    """STEP_GROUPS accepted groups shaped exactly like the ingest messages."""
    from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord

    rng = np.random.default_rng(0)
    return [
        AcceptedGroup(
            group_id=f"g{i}", prompt_index=i, prompt_tokens=prompts[i], policy_version=0, actor_id="bench",
            completions=[
                CompletionRecord(tokens=t, logprobs=lp, reward=r, finish_reason="length")
                for t, lp, r in completion_arrays(vocab, GROUP_SIZE, MAX_TOKENS, rng)
            ],
        )
        for i in range(STEP_GROUPS)
    ]


def _step_seconds(model_dir: Path, root: Path, repeats: int) -> float:
    """Median wall time of `Trainer.step` on one batch of STEP_GROUPS groups (after a warm-up step)."""
    from grpo_fleet.config import RunConfig
    from grpo_fleet.learner.run.build import build_learner
    from grpo_fleet.learner.step.batch import LengthShaping, build_train_batch

    cfg = RunConfig.model_validate({
        "run_dir": str(root / "step"),
        "model": {"path": str(model_dir)},  # the tiny model the ingest learner built
        "generation": {"group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS},
        "grpo": {"groups_per_step": STEP_GROUPS},
        "metrics": {"port": 0},
    })
    learner = build_learner(cfg)
    try:
        groups = _step_groups(learner.prompt_tokens, learner.policy.vocab_size)
        batch = build_train_batch(groups, scale_by_std=cfg.grpo.scales_by_std, lengths=LengthShaping.from_config(cfg))
        learner.trainer.step(batch)  # first call pays for graph and kernel setup
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            learner.trainer.step(batch)
            times.append(time.perf_counter() - started)
        return float(np.median(times))
    finally:
        learner.close()


# ---------------------------------------------------------------- figures


def _notes(result: Ingest) -> str:
    cores = f", learner CPU {result.learner_cores:.2f} cores" if result.learner_cores is not None else ""
    return (
        f"{result.groups_per_s:.0f} groups/s, {len(result.latencies_ms)} acks, {result.rejected} not accepted, "
        f"lease round trip p50 {np.percentile(result.lease_ms, 50):.2f} ms, "
        f"{result.empty_leases} empty leases{cores}; {GROUP_SIZE}x{MAX_TOKENS} tokens/group, "
        f"{GROUPS_PER_LEASE} groups/message, {os.cpu_count()} CPUs shared with the actors"
    )


def _actors(n: int) -> str:
    return f"{n} actor" if n == 1 else f"{n} actors"


def _report_ingest(report: Report, results: dict[int, Ingest]) -> None:
    for n, result in results.items():
        report.add(Figure("ingest", f"accepted tokens/s, {_actors(n)}", result.tokens_per_s, "tok/s",
                          goal=GOAL_TOKENS, notes=_notes(result)))
        report.add(Figure("ingest", f"p50 ack latency, {_actors(n)}", result.latency(50), "ms"))
        report.add(Figure("ingest", f"p99 ack latency, {_actors(n)}", result.latency(99), "ms"))
        if not result.learner_cores:
            continue  # no /proc (macOS): CPU use unknown
        # What one dedicated learner core would take: actors and other tenants share these CPUs.
        report.add(Figure("ingest", f"tokens per learner CPU-second, {_actors(n)}", result.tokens_per_learner_cpu_s,
                          "tok/cpu-s", notes="learner process CPU (incl. ZeroMQ I/O thread) from /proc"))


def _report_plumbing(report: Report, result: Ingest, step_s: float) -> None:
    ingest_s = STEP_GROUPS / result.groups_per_s
    report.add(Figure(
        "ingest", "plumbing share of a learner step", ingest_s, "s", baseline=step_s, baseline_name="Trainer.step",
        goal="< 5%",
        notes=f"wall time to ingest {STEP_GROUPS} groups at {result.actors} actors vs one tiny-model step on them"
        + (f"; learner CPU for them {STEP_GROUPS * result.learner_cores / result.groups_per_s:.4f} s"
           if result.learner_cores else ""),
    ))


def _report_curve(report: Report, plain: Ingest, curve: Ingest) -> None:
    n = plain.actors
    report.add(Figure("curve", f"CURVE accepted tokens/s, {n} actors", curve.tokens_per_s, "tok/s",
                      baseline=plain.tokens_per_s, baseline_name="plain tok/s", notes=_notes(curve)))
    report.add(Figure("curve", f"CURVE p50 ack latency, {n} actors", curve.latency(50), "ms",
                      baseline=plain.latency(50), baseline_name="plain p50 ms"))
    if not (curve.learner_cores and plain.learner_cores):
        return
    # Encryption runs in the learner's ZeroMQ I/O thread, so it shows up here even when tok/s is load-bound.
    report.add(Figure("curve", f"CURVE tokens per learner CPU-second, {n} actors", curve.tokens_per_learner_cpu_s,
                      "tok/cpu-s", baseline=plain.tokens_per_learner_cpu_s, baseline_name="plain tok/cpu-s"))


# ---------------------------------------------------------------- entry point

def _make_keys(directory: Path, actors: int) -> Path:
    from grpo_fleet.protocol.auth import add_actor, init_keys

    init_keys(directory)
    for i in range(actors):
        add_actor(directory, f"bench{i}")
    return directory


def _ingest_phases(root: Path, plan: Plan) -> tuple[dict[int, Ingest], Ingest]:
    """Start both learners and the actor pool, measure every phase, and kill them all."""
    keys = _make_keys(root / "keys", CURVE_ACTORS)
    learners: list[LearnerProcess] = []
    pool: Optional[ActorPool] = None
    try:
        learners.append(start_learner(root, "plain"))
        learners.append(start_learner(root, "curve", keys))
        pool = ActorPool(max(plan.actor_counts))  # spawns while the learners load
        plain, curve = learners
        wait_serving(plain)
        wait_serving(curve)
        results: dict[int, Ingest] = {}
        curve_result = Ingest(actors=CURVE_ACTORS)
        for n in plan.actor_counts:
            if n != CURVE_ACTORS:
                results[n] = _measure(pool, plain, n, plan, "plain")
                continue
            # Plain and CURVE take turns in ABBA order, so neither always goes first and a
            # load change on a shared machine hits both alike.
            results[n] = Ingest(actors=n)
            for turn in range(CURVE_TURNS):
                order = [(plain, results[n]), (curve, curve_result)]
                for learner, total in order if turn % 2 == 0 else order[::-1]:
                    total.merge(_measure(pool, learner, n, plan, f"{learner.run_dir.name}{turn}"))
        return results, curve_result
    finally:
        if pool is not None:
            pool.close()
        for learner in learners:
            stop_learner(learner)


def run(report: Report, scale: Scale) -> None:
    """Benchmarks 2 (ingest, plumbing share) and 6 (CURVE on the rollout path)."""
    plan = _plan(scale)
    with tempfile.TemporaryDirectory(prefix="grpo-fleet-ingest-") as tmp:
        root = Path(tmp)
        results, curve = _ingest_phases(root, plan)
        # After every process is gone, so the step is timed on an otherwise idle machine.
        step_s = _step_seconds(root / "plain" / "tiny-model", root, plan.step_repeats)
    _report_ingest(report, results)
    _report_plumbing(report, results[CURVE_ACTORS], step_s)
    _report_curve(report, results[CURVE_ACTORS], curve)
    from grpo_fleet.bench import hostile

    hostile.run(report, scale)  # the worst a single hostile message can hold the loop
