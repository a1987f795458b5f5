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


def test_an_only_run_goes_under_runs_beside_the_whole_run_and_a_whole_run_keeps_them(tmp_path, capsys):
    out = tmp_path / "results.json"
    Report(selection="default", durations={"rollout": 1.0}, figures=[Figure("rollout", "batched", 5.0, "tok/s")]).save(out)
    Report(selection="only", durations={"step_flops": 2.0}, figures=[Figure("step_flops", "ratio", 0.3, "x")]).save(out)
    Report(selection="only", durations={"step_flops": 3.0}, figures=[Figure("step_flops", "ratio", 0.4, "x")]).save(out)
    saved = json.loads(out.read_text())
    assert saved["set"] == "default" and saved["figures"][0]["name"] == "batched"  # the whole run, untouched
    assert list(saved["runs"]) == ["step_flops"] and saved["runs"]["step_flops"]["figures"][0]["value"] == 0.4
    Report(selection="default", durations={"rollout": 4.0}, figures=[Figure("rollout", "batched", 6.0, "tok/s")]).save(out)
    saved = json.loads(out.read_text())
    assert saved["benchmark_seconds"] == {"rollout": 4.0} and list(saved["runs"]) == ["step_flops"]


def test_a_results_file_that_is_not_json_is_kept_aside_not_overwritten(tmp_path, capsys):
    out = tmp_path / "results.json"
    out.write_text("{ half a file")
    Report(selection="only", durations={"ingest": 1.0}).save(out)
    assert (tmp_path / "results.json.unreadable").read_text() == "{ half a file"
    assert list(json.loads(out.read_text())["runs"]) == ["ingest"]
    assert "not readable JSON" in capsys.readouterr().out


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
