"""Does rejecting stale rollouts fall on long completions? (tinker-cookbook PR 822 reports that it does.)

A learner and 2 actors train the demo task with completions of up to
`max_tokens` tokens and a strict `grpo.max_staleness`, so that late leases are
refused. The learner's histograms of mean completion length per group, for the
groups refused as stale and for the accepted ones
(`grpo_fleet_learner_stale_group_tokens`, `_accepted_group_tokens`), are read
from its /metrics just before the run ends. A ratio above 1 means long
completions are refused more often, biasing training toward short ones.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Optional

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import demo_run_config
from grpo_fleet.bench.scraping import scrape as scrape_page
from grpo_fleet.launch.local_fleet import running
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.tasks import build_task

FAMILIES = ("grpo_fleet_learner_stale_group_tokens", "grpo_fleet_learner_accepted_group_tokens")


def scrape(port: int) -> Optional[dict[str, tuple[float, float]]]:
    """(sum, count) of each length histogram, or None while /metrics does not answer."""
    page = scrape_page(port)
    if page is None:
        return None
    return {name: (page.value(f"{name}_sum"), page.value(f"{name}_count")) for name in FAMILIES
            if any(key[0] == f"{name}_count" for key in page.samples)}


def run(report: Report, scale: Scale) -> None:
    steps, max_tokens = (150, 24) if scale is Scale.QUICK else (400, 48)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-stale-") as tmp:
        cfg = demo_run_config(Path(tmp), steps, seed=0)
        cfg = cfg.model_copy(update={
            "generation": cfg.generation.model_copy(update={"max_tokens": max_tokens}),
            "grpo": cfg.grpo.model_copy(update={"max_staleness": 0}),
            "train": cfg.train.model_copy(update={"eval_every": 0}),
        })
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
        config_path = Path(tmp) / "stale.json"
        config_path.write_text(json.dumps(cfg.model_dump(mode="json")))
        last: Optional[dict[str, tuple[float, float]]] = None
        with running(cfg, config_path, 2) as fleet:
            while fleet.learner.proc.poll() is None:
                last = scrape(cfg.metrics.port) or last
                time.sleep(0.5)
    _report(report, last or {}, max_tokens)


def _report(report: Report, histograms: dict[str, tuple[float, float]], max_tokens: int) -> None:
    stale_sum, stale_count = histograms.get(FAMILIES[0], (0.0, 0.0))
    ok_sum, ok_count = histograms.get(FAMILIES[1], (0.0, 0.0))
    if not stale_count or not ok_count:
        print("stale_lengths: no stale rejections or no accepted groups were seen; nothing to compare")
        return
    report.add(Figure(
        "stale_lengths", "mean completion tokens of groups refused as stale vs accepted", stale_sum / stale_count,
        "tokens", baseline=ok_sum / ok_count, baseline_name="accepted tokens", goal="~1x (no length bias)",
        notes=f"max_staleness 0, max_tokens {max_tokens}; {stale_count:.0f} groups refused as stale, "
              f"{ok_count:.0f} accepted ({stale_count / (stale_count + ok_count):.1%} refused)",
    ))
