"""The benchmark report: ratios, the printed table and results.json (the benchmarks themselves run in `make bench`)."""

from __future__ import annotations

import json

import pytest

from grpo_fleet.bench import BENCHMARKS, Figure, Report, Scale, load_benchmark, selected


def test_figures_carry_ratio_to_their_baseline_into_json(tmp_path, capsys):
    report = Report(scale="full", selection="full", durations={"rollout": 12.5})
    report.add(Figure("rollout", "batched", 500.0, "tok/s", baseline=100.0, baseline_name="naive", goal=">= 5x"))
    report.add(Figure("ingest", "p50", 2.5, "ms"))
    printed = capsys.readouterr().out
    assert "ratio 5x" in printed and "(goal >= 5x)" in printed
    assert "| rollout | batched | 500 tok/s | 100 (naive) | 5x | >= 5x |" in report.table()
    report.save(tmp_path / "results.json")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["figures"][0]["ratio"] == 5.0 and saved["figures"][1]["ratio"] is None
    assert saved["machine"]["cpus"] >= 1 and "mlx" in saved["machine"]
    assert saved["set"] == "full" and saved["scale"] == "full" and saved["benchmark_seconds"] == {"rollout": 12.5}


def test_every_benchmark_module_loads_and_unknown_names_are_refused():
    for bench in BENCHMARKS:
        assert callable(load_benchmark(bench.name))
    with pytest.raises(SystemExit, match="unknown benchmark"):
        load_benchmark("nope")


def test_default_set_leaves_the_long_sweeps_to_the_full_run():
    default = [b.name for b in selected(None, Scale.DEFAULT)]
    full = [b.name for b in selected(None, Scale.FULL)]
    assert "qwen_step" not in default and "offpolicy" not in default
    # The real model's decode race and its learning race fit the half hour; one learner step's tok/s does not.
    assert "real_decode" in default and "real" in default and "real_step" not in default
    assert full == [b.name for b in BENCHMARKS] and set(default) < set(full)
    assert [b.name for b in selected(["qwen_step", "rollout"], Scale.DEFAULT)] == ["qwen_step", "rollout"]


def test_default_set_fits_its_half_hour():
    # Each row's minutes are as measured on the 2-vCPU reference VM; make bench promises about 30 in all.
    assert sum(b.minutes for b in selected(None, Scale.DEFAULT)) <= 30.0
