"""Experiment trackers (learner/records/trackers.py): config, the scalars of a step, TensorBoard read back, failures contained.

W&B starts a service process, so its test is in tests/integration/test_trackers_wandb.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Mapping

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_learner_core import ACTOR_A, ask, hello, lease, rollouts_for, run_config

from grpo_fleet.config import LoggingConfig, RunConfig, load_run_config
from grpo_fleet.learner.records.runlog import StepRecord
from grpo_fleet.learner.records.trackers import (
    TensorBoardTracker,
    Trackers,
    TrackerUnavailable,
    build_trackers,
    require_installed,
    scalars_of,
)
from helpers import step_record
from in_process import build_learner

ERRORS = "grpo_fleet_learner_tracker_errors_total"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def errors(registry: CollectorRegistry) -> Counter:
    return Counter("grpo_fleet_learner_tracker_errors", "test", ["tracker"], registry=registry)


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar TensorBoard itself would show from `logdir`, resumes purged."""
    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# ----------------------------------------------------------------- config and scalars


def test_trackers_are_off_by_default_and_named_in_one_list():
    assert RunConfig().logging.report_to == []
    assert RunConfig().logging.wandb_mode == "offline", "the default needs no network and no account"
    cfg = load_run_config(None, ['logging.report_to=["tensorboard", "wandb"]', "logging.wandb_project=demo"])
    assert cfg.logging.report_to == ["tensorboard", "wandb"] and cfg.logging.wandb_project == "demo"


@pytest.mark.parametrize("report_to", [["mlflow"], ["tensorboard", "tensorboard"]])
def test_an_unknown_or_repeated_tracker_is_refused(report_to):
    with pytest.raises(ValidationError, match="report_to"):
        LoggingConfig(report_to=report_to)


def test_a_step_reports_its_numbers_and_leaves_out_step_null_and_text():
    scalars = scalars_of(step_record(3))
    episodes_only = {"episode_turns_mean", "tool_calls_per_episode", "tool_call_episode_fraction",
                     "tool_call_malformed_fraction"}  # null in a run of single replies: left out, as skipped is
    numeric = {f.name for f in dataclasses.fields(StepRecord)} - {"step", "skipped"}
    assert set(scalars) == numeric - episodes_only
    with_episodes = scalars_of(step_record(3, **{name: 0.5 for name in episodes_only}))
    assert set(with_episodes) == numeric
    assert scalars["reward_mean"] == 0.75 and scalars["tokens"] == 27.0 and isinstance(scalars["tokens"], float)
    assert "skipped" not in scalars_of(step_record(3, skipped="nonfinite_loss", loss=float("nan")))
    assert np.isnan(scalars_of(step_record(3, skipped="nonfinite_loss", loss=float("nan")))["loss"])
    with pytest.raises(TypeError, match="dataclass"):
        scalars_of({"step": 1, "loss": 0.5})


# ----------------------------------------------------------------- TensorBoard, written and read back


def test_tensorboard_gets_every_step_at_its_global_step(tmp_path, errors, registry):
    cfg = RunConfig(run_dir=str(tmp_path), logging=LoggingConfig(report_to=["tensorboard"]))
    trackers = build_trackers(cfg, tmp_path, errors, run_id="run0")
    assert trackers.names == ["tensorboard"]
    records = [step_record(step) for step in (1, 2, 3)]
    for record in records:
        trackers.log_record(record)
    trackers.log(3, {"eval/reward": 0.375})  # eval rows go the same way
    trackers.close()

    shown = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(shown) == set(scalars_of(records[0])) | {"eval/reward"}
    assert shown["reward_mean"] == [(r.step, r.reward_mean) for r in records]
    assert shown["tokens"] == [(r.step, float(r.tokens)) for r in records]
    assert [v for _, v in shown["learning_rate"]] == pytest.approx([1e-4] * 3)  # stored as float32
    assert shown["eval/reward"] == [(3, 0.375)]
    assert registry.get_sample_value(ERRORS, {"tracker": "tensorboard"}) is None, "nothing failed"


def test_a_resumed_run_replaces_the_steps_it_redoes(tmp_path, errors):
    logdir = tmp_path / "tb"
    cfg = RunConfig(run_dir=str(tmp_path), logging=LoggingConfig(report_to=["tensorboard"], tensorboard_dir=str(logdir)))
    first = build_trackers(cfg, tmp_path, errors, run_id="run0")
    for step in (1, 2, 3, 4):  # then the process dies; the checkpoint it resumes from is at step 2
        first.log(step, {"reward_mean": float(step)})
    first.close()
    resumed = build_trackers(cfg, tmp_path, errors, run_id="run0", first_step=3)
    for step in (3, 4, 5):
        resumed.log(step, {"reward_mean": 10.0 * step})
    resumed.close()
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2
    assert tensorboard_scalars(logdir)["reward_mean"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


# ----------------------------------------------------------------- failures


class BrokenTracker:
    """A tracker whose backend has gone away (a full disk, a dead service): every call raises."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.calls += 1
        raise OSError(f"no space left on device (step {step})")

    def close(self) -> None:
        raise OSError("no space left on device")


def test_a_failing_tracker_is_counted_and_warned_about_once_and_the_others_go_on(tmp_path, errors, registry, caplog):
    broken = BrokenTracker()
    trackers = Trackers([broken, TensorBoardTracker(tmp_path, first_step=1)], errors)
    with caplog.at_level(logging.WARNING, logger="grpo_fleet.learner"):
        for step in (1, 2, 3):
            trackers.log_record(step_record(step))
        trackers.close()
    assert broken.calls == 3, "a failure does not switch the tracker off: the next step tries again"
    assert registry.get_sample_value(ERRORS, {"tracker": "broken"}) == 4, "three logs and the close"
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "no space left" in warnings[0] and ERRORS in warnings[0]
    assert [s for s, _ in tensorboard_scalars(tmp_path)["loss"]] == [1, 2, 3]
    trackers.log(4, {"loss": 0.0})  # closed: nothing left to report to, and nothing raises
    assert registry.get_sample_value(ERRORS, {"tracker": "broken"}) == 4


def test_a_missing_library_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    with pytest.raises(TrackerUnavailable, match=r"pip install 'grpo-fleet\[wandb\]'"):
        require_installed(LoggingConfig(report_to=["tensorboard", "wandb"]))
    require_installed(LoggingConfig(report_to=["tensorboard"]))


def test_the_learner_refuses_a_missing_tracker_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    cfg = RunConfig(run_dir=str(tmp_path / "run"), model={"path": str(tmp_path / "no-such-model")},
                    logging=LoggingConfig(report_to=["tensorboard"]))
    with pytest.raises(TrackerUnavailable, match=r"grpo-fleet\[tensorboard\]"):
        build_learner(cfg)  # a model load would have failed on the missing directory instead
    assert not (tmp_path / "run" / "config.json").exists()


# ----------------------------------------------------------------- the learner's own path


def train_one_step(learner) -> StepRecord:
    hello(learner)
    ask(learner, ACTOR_A, rollouts_for(lease(learner)))
    return learner.train_step()


def test_the_learner_reports_each_step_and_closes_its_trackers(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path / "run", logging={"report_to": ["tensorboard"]})
    learner = build_learner(cfg)
    assert learner.trackers.names == ["tensorboard"]
    first = train_one_step(learner)
    learner.close()
    assert learner.trackers.trackers == [], "closed on shutdown"
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    resumed = build_learner(cfg, resume=True)  # continues after the step-1 checkpoint
    assert resumed.state.run_id == learner.state.run_id, "the W&B run id, so W&B continues the same run"
    second = train_one_step(resumed)
    resumed.close()

    shown = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert (first.step, second.step) == (1, 2)
    assert shown["reward_mean"] == [(1, pytest.approx(line["reward_mean"])), (2, pytest.approx(second.reward_mean))]
    assert shown["groups"] == [(1, float(line["groups"])), (2, float(second.groups))]
    assert resumed.metrics.registry.get_sample_value(ERRORS, {"tracker": "tensorboard"}) is None
