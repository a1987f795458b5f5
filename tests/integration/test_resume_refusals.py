"""`grpo-fleet learner --resume` on a run directory a checkpoint no longer matches: refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_fleet.learner.records.persistence import read_state
from grpo_fleet.learner.records.runlog import LEDGER_FILE, LedgerEntry
from grpo_fleet.learner.run.build import build_learner


def test_a_resume_on_a_ledger_shorter_than_the_checkpoint_is_refused_in_one_line(run_config, spawn):
    _, cfg = run_config()
    learner = build_learner(cfg)
    for n in range(3):
        learner.runlog.ledger(LedgerEntry(group_id=f"g{n}", prompt_index=n, actor_id="a", actor_key="k",
                                          policy_version=0, step=0))
    checkpoint = learner.checkpoint()
    learner.close()
    ledger = Path(cfg.run_dir) / LEDGER_FILE
    recorded = read_state(checkpoint)["ledger_bytes"]
    os.truncate(ledger, recorded - 30)  # its last line lost (a disk that lied about a flush, a hand edit)
    resumed = spawn("learner", "--resume", cfg.run_dir, name="resumed")
    assert resumed.wait(timeout=120) == 2
    output = resumed.log_path.read_text()
    assert "Traceback" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "shorter than the" in line]
    assert len(said) >= 1 and str(ledger) in said[-1] and f"{recorded - 30} bytes" in said[-1], output[-3000:]
    assert ledger.stat().st_size == recorded - 30  # nothing cut, nothing appended
