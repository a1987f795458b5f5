"""With several data-parallel ranks under LoRA, older flagged groups are recomputed inside the step by the ranks
that train their rows, not by rank 0 before it (learner/verify/batch_checks.py); a step's check seconds are its slowest
rank's. Rank 0 is the in-process learner; its peers' share of the work is done in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from test_learner_core import ACTOR_A, GROUPS_PER_STEP, ask, run_config
from test_verification import _one_behind, checks, rejections, shifted

from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.step.rows import SingleProcess
from grpo_fleet.protocol.reasons import RejectReason
from helpers import jsonl
from in_process import build_learner

SLOWEST = 7.0  # seconds the slowest rank spent on a step's checks


class _TwoRanksInOne(SingleProcess):
    """A rank 0 of two as the run sees it: every row is computed here, and the other rank was slower."""

    size = 2

    def __init__(self) -> None:
        self.gathered = 0

    def gather_rows(self, values: np.ndarray, total: int) -> np.ndarray:
        self.gathered += 1
        return values

    def slowest(self, seconds: float) -> float:
        return max(seconds, SLOWEST)


@pytest.fixture
def two_ranks(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[RunCoordinator, _TwoRanksInOne]]:
    """A verifying LoRA learner that is rank 0 of two."""
    cfg = run_config(tiny_model_dir, tmp_path / "run", security={"verify_logprobs": True}, grpo={"max_staleness": 2},
                     lora={"enabled": True})
    learner = build_learner(cfg)
    learner.trainer.sharding = sharding = _TwoRanksInOne()
    yield learner, sharding
    learner.close()


def _forwards_on_rank0(learner: RunCoordinator) -> float:
    """Groups rank 0 recomputed itself (LogprobCheck, before the step)."""
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_check_seconds_count") or 0.0


def test_older_groups_are_checked_inside_the_step_and_it_logs_the_slowest_ranks_seconds(two_ranks) -> None:
    learner, sharding = two_ranks
    assert ask(learner, ACTOR_A, _one_behind(learner)).status == "accepted"
    assert all(g.check_logprobs for g in learner.state.buffer), "on probation: every group is flagged"
    assert learner.train_step() is not None and learner.state.step == 2
    assert sharding.gathered == 1, "the ranks' recomputed rows were gathered once"
    assert checks(learner, "forward", "passed") == GROUPS_PER_STEP and _forwards_on_rank0(learner) == 0
    learner.runlog.sizes()  # flushes
    steps = [line for line in jsonl(Path(learner.cfg.run_dir) / "metrics.jsonl") if "event" not in line]
    assert steps[-1]["check_seconds"] == SLOWEST and steps[-1]["groups_checked"] == GROUPS_PER_STEP
    histogram = learner.metrics.registry.get_sample_value("grpo_fleet_learner_step_check_seconds_sum")
    assert histogram is not None and histogram >= SLOWEST


def test_a_lie_in_an_older_group_is_caught_inside_the_step_and_never_trains(two_ranks) -> None:
    learner, sharding = two_ranks
    liar = shifted(_one_behind(learner), -0.02)  # under the step's screen: only a recomputation at v0 sees it
    assert ask(learner, ACTOR_A, liar).status == "accepted"
    assert learner.train_step() is None and learner.state.step == 1, "nothing of it trained"
    assert sharding.gathered == 1 and _forwards_on_rank0(learner) == 0
    assert learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP
    assert checks(learner, "forward", "failed") >= 1
