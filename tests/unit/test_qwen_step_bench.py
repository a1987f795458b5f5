"""The real-shape learner-step benchmark's step (`measure`): full vocabulary, one block, short sequences."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_fleet.bench import Report
from grpo_fleet.bench.qwen_step import QUICK, measure

# A third of QUICK's tokens (at 151,936 ids the LM head is most of a step: 43 CPU-s there), with a micro-batch of one
# group's 8 x 40 tokens, so that the second group is a second micro-batch, as each group is in the flagship config.
SHORT = replace(QUICK, prompt_tokens=16, completion_tokens=24, micro_batch_tokens=8 * 40)


@pytest.mark.slow
def test_the_config_step_keeps_its_peak_memory_when_the_groups_double(realshape_model_dir, realshape_cache_dir,
                                                                      monkeypatch):
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(realshape_cache_dir))  # reuse the session's build
    report = Report()
    measure(report, SHORT)
    figures = {f.name: f for f in report.figures}
    ratio = next(f for name, f in figures.items() if "/ at" in name)
    # Micro-batching: twice the groups, the same micro-batches' worth of memory (plus a little).
    assert ratio.ratio is not None and ratio.ratio <= 1.15, ratio
    assert all(f.value > 0 for f in report.figures)
