"""Benchmarks behind `grpo-fleet bench` / `make bench`.

Each benchmark measures a figure and its baseline in the same run and reports
the ratio; nothing here asserts on time. Results go to stdout as a table and to
`bench/results.json` with a description of the machine and the set that ran.

`make bench` runs the default set (`BENCHMARKS` rows with default=True, at
`Scale.DEFAULT`), about 30 minutes on the 2-vCPU reference VM; `make bench-full`
runs every row at `Scale.FULL`, the long sweeps included (hours).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Optional, cast

from grpo_fleet.runtime.durable import write_atomic


@dataclass
class Figure:
    """One measured number, next to its baseline from the same run."""

    benchmark: str
    name: str
    value: float
    unit: str
    baseline: Optional[float] = None
    baseline_name: Optional[str] = None
    goal: Optional[str] = None
    notes: str = ""

    @property
    def ratio(self) -> Optional[float]:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline


@dataclass
class Report:
    """All figures of one `grpo-fleet bench` run."""

    figures: list[Figure] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    scale: str = "default"
    selection: str = "default"  # "default" (make bench), "full" (make bench-full) or "only" (--only)
    durations: dict[str, float] = field(default_factory=dict)  # benchmark -> seconds

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        ratio = f"  ratio {figure.ratio:.3g}x" if figure.ratio is not None else ""
        base = f"  vs {figure.baseline_name} {figure.baseline:.4g}" if figure.baseline is not None else ""
        goal = f"  (goal {figure.goal})" if figure.goal else ""
        print(f"[{figure.benchmark}] {figure.name}: {figure.value:.4g} {figure.unit}{base}{ratio}{goal}", flush=True)
        return figure

    def table(self) -> str:
        rows = ["| benchmark | figure | value | baseline | ratio | goal |", "|---|---|---|---|---|---|"]
        for f in self.figures:
            base = f"{f.baseline:.4g} ({f.baseline_name})" if f.baseline is not None else "—"
            ratio = f"{f.ratio:.3g}x" if f.ratio is not None else "—"
            rows.append(f"| {f.benchmark} | {f.name} | {f.value:.4g} {f.unit} | {base} | {ratio} | {f.goal or '—'} |")
        return "\n".join(rows)

    def save(self, path: Path) -> None:
        """Write this run into `path`, keeping what the file already records: an `--only` run goes under
        `runs`, keyed by its benchmarks, beside the last whole run; a whole run keeps the `--only` runs."""
        payload = {
            "machine": machine_description(),
            "started": self.started,
            "seconds": time.time() - self.started,
            "set": self.selection,
            "scale": self.scale,
            "benchmark_seconds": self.durations,
            "figures": [{**asdict(f), "ratio": f.ratio} for f in self.figures],
        }
        kept = _recorded(path)
        runs = kept.pop("runs", {}) if isinstance(kept.get("runs"), dict) else {}
        if self.selection == "only":
            runs["+".join(self.durations) or "only"] = payload
            whole = kept if kept.get("set") in ("default", "full") else {}
            payload = {**whole, "runs": runs}
        elif runs:
            payload["runs"] = runs
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: the file now carries earlier runs too, and a bench stopped mid-write must not lose them.
        write_atomic(path, (json.dumps(payload, indent=2) + "\n").encode())


def _recorded(path: Path) -> dict:
    """What `path` already records (a results.json), or {} when there is none; one that cannot be read is
    kept beside it as PATH.unreadable rather than overwritten."""
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"{path} is not readable JSON ({exc}): kept as {path}.unreadable", flush=True)
        path.replace(path.with_name(path.name + ".unreadable"))
        return {}
    return recorded if isinstance(recorded, dict) else {}


def machine_description() -> dict:
    """What the figures were measured on."""
    import mlx.core as mx

    from grpo_fleet.runtime.doctor import blas_description, mlx_version

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mlx_version(),
        "device": str(mx.default_device()),
        "blas": blas_description(),
    }


class Scale(str, Enum):
    """How big a run is: every benchmark picks its sizes from this."""

    QUICK = "quick"  # smoke sizes, a few minutes in all
    DEFAULT = "default"  # `make bench`: about 30 minutes on the 2-vCPU reference VM
    FULL = "full"  # `make bench-full`: every size and sweep (hours: the Qwen-shape step alone is one)


BenchFn = Callable[[Report, Scale], None]


@dataclass(frozen=True)
class Benchmark:
    """One entry of the table below: a name, the function that runs it, and whether `make bench` runs it.

    `target` is "module:function" under grpo_fleet.bench (function defaults to
    `run`), called as `function(report, scale)`. `minutes` is what it took at the
    default scale (the full one for full-only entries) on the 2-vCPU reference
    VM, to keep the default set within its budget.
    """

    name: str
    target: str
    default: bool
    minutes: float
    about: str = ""


# The registration point: add a row here and `--only NAME` runs it; `default=True` puts it in `make bench`.
# In the order both sets run them.
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("rollout", "rollout", True, 0.6, "actor tok/s vs naive mlx_lm.generate (tiny; 50M + shared prefix: full)"),
    Benchmark("ingest", "ingest", True, 1.1, "learner intake tok/s and ack latency by actor count; CURVE; hostile"),
    Benchmark("weights", "weights", True, 0.5, "LoRA and full weight broadcast vs raw ZeroMQ"),
    Benchmark("step", "step", True, 0.1, "learner step phases, eager vs mx.compile (50M and memory rows: full)"),
    Benchmark("real_decode", "real_decode", True, 3.4, "real model: actor lease vs mlx_lm.batch_generate, idle slots"),
    Benchmark("long_decode", "long_decode", False, 8.3,
              "real model, long answers: rolling actor vs mlx_lm.batch_generate lease by lease, idle slots"),
    Benchmark("real_step", "real_step", False, 3.7, "real model: one Trainer.step tok/s, micro-batch padding"),
    Benchmark("episodes", "episodes", False, 3.0,
              "real model: CapitalQuiz episodes vs single-turn groups (tok/s of each kind, idle slots, learner step)"),
    Benchmark("step_flops", "step_flops", False, 10.0,
              "learner step's achieved FLOP/s vs doctor's matmul GF/s: SmolLM2-135M LoRA and the Qwen shape, also at "
              "128/512/1,024 completion tokens with the pi_ref pass's share; padding of completions spread 16..512"),
    Benchmark("gguf_import", "gguf_import", False, 0.5, "import-gguf on Gemma 3 270M Q4_K_M: time, peak memory vs model size"),
    Benchmark("export_gguf", "export_gguf", True, 0.3,
              "export SmolLM2-135M + LoRA to Q8_0: time, peak memory (full: llama.cpp's greedy tokens vs mlx-lm's)"),
    Benchmark("real", "real", True, 23.5, "real model learning: fleet vs in-process loop vs mlx-lm-lora, same task"),
    Benchmark("mixed", "mixed", True, 0.5, "capacity-sized leases with a 10x slower actor"),
    Benchmark("two_macs", "two_macs", False, 50.0,  # estimated from its smoke run: FULL not yet measured
              "two cores as two Macs, 256-token answers: fleet (learner + actor, a core each) vs mlx-lm-lora on one "
              "core, s/step and the bound (gen + train) / max"),
    Benchmark("late_leases", "late_leases", False, 1.6,
              "long answers past their lease deadline: work thrown away, leases extended while heartbeating or not"),
    Benchmark("e2e", "e2e", False, 4.3, "tiny demo: wall time to its target, fleet vs batched loop and notebook loop"),
    Benchmark("data_parallel", "data_parallel", False, 5.0,
              "data-parallel learner: 50M step and gradient all-reduce at 1 and 2 ranks, LoRA and full"),
    Benchmark("fleet_sim", "fleet_sim", False, 8.0,
              "fleet simulator vs real fleets (real model, 1 and 2 actors); Macs and ranks it plans for"),
    Benchmark("logprob_gap", "logprob_gap", False, 2.8, "actor/learner logprob gap in fp32 and bf16"),
    Benchmark("stale_lengths", "stale_lengths", False, 2.8, "stale rejections against completion length"),
    Benchmark("offpolicy", "offpolicy", False, 26.0, "coupled vs decoupled objective under lag (3 seeds x 600 steps)"),
    Benchmark("liar_lags", "liar_lags", False, 3.0,
              "logprob check vs quiet liars (stale weights, spikes, false finish) and a sleeper's exposure"),
    Benchmark("qwen_step", "qwen_step", False, 120.0, "Qwen2.5-0.5B-shaped learner step sweep and actor lease"),
    Benchmark("offpolicy_real", "offpolicy_real", False, 60.0, "real model: coupled vs decoupled at staleness 1 and 4"),
    Benchmark("offpolicy_long", "offpolicy_long", False, 35.0,  # estimated: two_macs' 75 s a 1,000 tokens
              "real model, long answers at the simulator's staleness for 8 Macs (2): default objective vs the "
              "alternatives, and beta 0 (held-out reward, gap, clip, s/step, pi_ref share, KL)"),
    Benchmark("logprob_gap_real", "logprob_gap_real", False, 7.0, "real model: honest logprob gaps vs the check's bound"),
)


def benchmark_named(name: str) -> Benchmark:
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    raise SystemExit(f"unknown benchmark {name!r}; choose from {', '.join(b.name for b in BENCHMARKS)}")


def load_benchmark(name: str) -> BenchFn:
    """Import one benchmark's module only when it is asked for."""
    import importlib

    module, _, function = benchmark_named(name).target.partition(":")
    return cast(BenchFn, getattr(importlib.import_module(f"grpo_fleet.bench.{module}"), function or "run"))


def selected(names: Optional[list[str]], scale: Scale) -> list[Benchmark]:
    """The benchmarks a run covers: `names` if given, else the default set (every one at the full scale)."""
    if names:
        return [benchmark_named(name) for name in names]
    return [b for b in BENCHMARKS if b.default or scale is Scale.FULL]


def run_benchmarks(names: Optional[list[str]], scale: Scale, out: Path) -> Report:
    """Run the chosen benchmarks, print the table, write results.json (with the set and scale that ran)."""
    chosen = selected(names, scale)
    report = Report(scale=scale.value, selection="only" if names else ("full" if scale is Scale.FULL else "default"))
    for bench in chosen:
        runner = load_benchmark(bench.name)
        print(f"== {bench.name}", flush=True)
        start = time.perf_counter()
        runner(report, scale)
        report.durations[bench.name] = time.perf_counter() - start
    print("\n" + report.table())
    report.save(out)
    print(f"\nwrote {out}")
    return report
