"""Benchmarks behind `grpo-fleet bench` / `make bench`.

Each benchmark measures a figure and its baseline in the same run and reports
the ratio; nothing here asserts on time. Results go to stdout as a table and to
`bench/results.json` with a description of the machine.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional


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
        payload = {
            "machine": machine_description(),
            "started": self.started,
            "seconds": time.time() - self.started,
            "figures": [{**asdict(f), "ratio": f.ratio} for f in self.figures],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))


def machine_description() -> dict:
    """What the figures were measured on."""
    import mlx.core as mx

    from grpo_fleet.doctor import blas_description, mlx_version

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mlx_version(),
        "device": str(mx.default_device()),
        "blas": blas_description(),
    }


BenchFn = Callable[[Report, bool], None]


# Benchmark name -> module with `run(report, quick)`, in the order `make bench` runs them.
BENCHMARKS: tuple[str, ...] = ("rollout", "ingest", "weights", "step", "qwen_step", "mixed", "e2e", "offpolicy",
                               "logprob_gap", "stale_lengths")
BENCHMARKS += ("offpolicy_real",)  # coupled vs decoupled on the real model, at the fleet's staleness and at lag 4
BENCHMARKS += ("logprob_gap_real",)  # honest logprob gaps on real text against security.max_logprob_gap


def load_benchmark(name: str) -> BenchFn:
    """Import one benchmark module only when it is asked for."""
    import importlib

    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"grpo_fleet.bench.{name}").run


def run_benchmarks(names: Optional[list[str]], quick: bool, out: Path) -> Report:
    """Run the chosen benchmarks (all by default), print the table, write results.json."""
    report = Report()
    for name in names or list(BENCHMARKS):
        runner = load_benchmark(name)
        print(f"== {name}", flush=True)
        runner(report, quick)
    print("\n" + report.table())
    report.save(out)
    print(f"\nwrote {out}")
    return report
