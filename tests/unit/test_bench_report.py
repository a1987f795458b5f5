"""The benchmark report: ratios, the printed table and results.json (the benchmarks themselves run in `make bench`)."""

from __future__ import annotations

import json

import pytest

from grpo_fleet.bench import BENCHMARKS, Figure, Report, load_benchmark


def test_figures_carry_ratio_to_their_baseline_into_json(tmp_path, capsys):
    report = Report()
    report.add(Figure("rollout", "batched", 500.0, "tok/s", baseline=100.0, baseline_name="naive", goal=">= 5x"))
    report.add(Figure("ingest", "p50", 2.5, "ms"))
    printed = capsys.readouterr().out
    assert "ratio 5x" in printed and "(goal >= 5x)" in printed
    assert "| rollout | batched | 500 tok/s | 100 (naive) | 5x | >= 5x |" in report.table()
    report.save(tmp_path / "results.json")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["figures"][0]["ratio"] == 5.0 and saved["figures"][1]["ratio"] is None
    assert saved["machine"]["cpus"] >= 1 and "mlx" in saved["machine"]


def test_every_benchmark_module_loads_and_unknown_names_are_refused():
    for name in BENCHMARKS:
        assert callable(load_benchmark(name))
    with pytest.raises(SystemExit, match="unknown benchmark"):
        load_benchmark("nope")
