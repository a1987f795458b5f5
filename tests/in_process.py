"""The learner built as the unit tests may: rewards scored, and environments replayed, in this process (unit tests
start no process).

The learner itself re-scores submissions in a process of its own (ScoringProcess),
which can kill a reward that hangs, and replays environments in another
(EnvProcess); the integration tests run it that way.
"""

from __future__ import annotations

from typing import Any

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.hosting import InlineEnvs
from grpo_fleet.learner.run.build import build_learner as build_learner_with_processes
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.tasks.reward_runner import InlineScorer


def build_learner(cfg: RunConfig, **options: Any) -> RunCoordinator:
    return build_learner_with_processes(cfg, make_scorer=InlineScorer, make_envs=InlineEnvs, **options)
