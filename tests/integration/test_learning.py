"""Learning happens: the demo's learner and two actors, over TCP, raise the held-out reward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fleet.runtime.blas import child_env

# The demo reaches ~0.8 held-out in 1,500 steps from ~0.04 at its lr of 1e-4; 400 steps gave
# 0.04 -> 0.30 (+0.27), too close to the bar for an asynchronous run. At 2.5e-4 (5e-4 collapses
# this model) 300 steps gave +0.37, +0.47 and +0.47 in three runs on a loaded machine: the same
# bar with more margin in half the steps. What is tested is that the fleet learns, not the lr.
STEPS = 300
LR = 2.5e-4
RISE = 0.2


@pytest.mark.slow
def test_demo_fleet_raises_held_out_reward(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "grpo_fleet", "demo", "--steps", str(STEPS), "--run-dir", str(run_dir),
         "--no-progress", "--set", f"optim.lr={LR}"],
        env=child_env(), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    rise = summary["eval_reward_after"] - summary["eval_reward_before"]
    assert rise >= RISE, summary
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "event" not in r]
    rounds = [r for r in lines if r.get("event") == "eval"]
    # Before and after are the learner's own eval rounds: at step 0 and after the last step.
    assert [r["step"] for r in rounds][0] == 0 and rounds[-1]["step"] == STEPS
    assert summary["eval_reward_after"] == rounds[-1]["eval_reward"]
    # Training reward moved too, not only the final greedy evaluation.
    first, last = records[: len(records) // 10], records[-len(records) // 10 :]
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)  # noqa: E731
    assert mean(last) > mean(first), (mean(first), mean(last))
