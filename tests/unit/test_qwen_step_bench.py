"""The real-shape learner-step benchmark's quick variant: full vocabulary, one block, short sequences."""

from __future__ import annotations

import pytest

from grpo_fleet.bench import Report
from grpo_fleet.bench.qwen_step import QUICK, measure


@pytest.mark.slow
def test_quick_qwen_config_step_reports_bounded_peak_memory(realshape_model_dir, realshape_cache_dir, monkeypatch):
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(realshape_cache_dir))  # reuse the session's build
    report = Report()
    measure(report, QUICK)
    figures = {f.name: f for f in report.figures}
    ratio = next(f for name, f in figures.items() if "/ at" in name)
    # Micro-batching: twice the groups, the same micro-batches' worth of memory (plus a little).
    assert ratio.ratio is not None and ratio.ratio <= 1.15, ratio
    assert all(f.value > 0 for f in report.figures)
