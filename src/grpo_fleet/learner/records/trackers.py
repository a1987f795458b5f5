"""Experiment trackers (TensorBoard, Weights & Biases): the numbers of every step, for comparing runs.

Prometheus is the live view of a fleet; a tracker keeps each run's curves to set
beside other runs'. Each is an optional extra, imported only when
`logging.report_to` names it. A tracker is reporting, not training: one that
fails mid-run is warned about once and counted in
`grpo_fleet_learner_tracker_errors_total{tracker}`, and the run goes on.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from prometheus_client import Counter

from grpo_fleet.config import LoggingConfig, RunConfig

log = logging.getLogger("grpo_fleet.learner")

# The module each tracker needs; the pip extra that installs it has the tracker's name.
TRACKER_MODULES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


class TrackerUnavailable(RuntimeError):
    """A tracker logging.report_to names cannot start: its library is not installed, or it refused to open."""


class Tracker(Protocol):
    """Where scalars go: `log` a dict of them at a global step (training steps, or evaluations at one)."""

    name: str

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: Any) -> dict[str, float]:
    """A dataclass record's numbers by field name; None, text and flags are left out, and so is `step` (the x-axis)."""
    if not is_dataclass(record):
        raise TypeError(f"scalars_of takes a dataclass record, not {type(record).__name__}")
    values = ((f.name, getattr(record, f.name)) for f in fields(record) if f.name != "step")
    return {name: float(value) for name, value in values
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def require_installed(cfg: LoggingConfig) -> None:
    """Fail now, naming the extra to install, rather than after the model has loaded."""
    for name in cfg.report_to:
        module = TRACKER_MODULES[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TrackerUnavailable(
                f"logging.report_to includes {name!r}, but {module} is not installed ({exc}): "
                f"pip install 'grpo-fleet[{name}]'"
            ) from exc


class TensorBoardTracker:
    """Scalars into event files that `tensorboard --logdir` reads (tensorboardX: no torch or TensorFlow needed)."""

    name = "tensorboard"

    def __init__(self, logdir: Path, first_step: int) -> None:
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard hides what an earlier process logged at or after the step this one starts at,
        # as metrics.jsonl is cut back on resume. Files are named by the second they were opened; the nanosecond
        # suffix keeps two writers of one second apart and in order (TensorBoard reads the files sorted by name).
        self._writer = SummaryWriter(logdir=str(logdir), purge_step=first_step, filename_suffix=f".{time.time_ns()}")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()  # a crash loses no more here than in the line-buffered metrics.jsonl

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run under RUN_DIR/wandb, its id the learner's run id so a resume continues it."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str) -> None:
        import wandb

        settings = cfg.logging
        self._run = wandb.init(
            project=settings.wandb_project, entity=settings.wandb_entity, name=settings.wandb_name or run_dir.name,
            id=run_id, resume="allow", dir=str(run_dir), mode=settings.wandb_mode,
            config=cfg.model_dump(mode="json"),
            # The learner's own log already has its console; W&B's capture would wrap sys.stdout of a server.
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        # W&B keeps steps increasing: after a resume it drops (with a warning) the redone steps it already has.
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class Trackers:
    """Every configured tracker, each call guarded: a failure is counted, warned about once per tracker, and skipped."""

    def __init__(self, trackers: Sequence[Tracker], errors: Counter) -> None:
        self.trackers = list(trackers)
        self._errors = errors
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self.trackers]

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Report `scalars` at `step` to each tracker (eval rows too, e.g. {"eval/reward": 0.4})."""
        for tracker in self.trackers:
            try:
                tracker.log(step, scalars)
            except Exception as exc:  # whatever a tracker raises, training goes on
                self._failed(tracker, "log", exc)

    def adopt(self, opened: Trackers) -> None:
        """Report to `opened`'s trackers too, from now on (they are opened once the run's first step is known)."""
        self.trackers.extend(opened.trackers)

    def log_record(self, record: Any) -> None:
        """A step record (a dataclass with `step`), as its numeric fields at global step = record.step."""
        self.log(record.step, scalars_of(record))

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # the others still close, and the run's own files too
                self._failed(tracker, "close", exc)
        self.trackers = []

    def _failed(self, tracker: Tracker, action: str, exc: Exception) -> None:
        self._errors.labels(tracker=tracker.name).inc()
        if tracker.name not in self._warned:
            self._warned.add(tracker.name)
            log.warning("tracker %s failed to %s (%s: %s); training goes on, later failures are only counted in "
                        "grpo_fleet_learner_tracker_errors_total", tracker.name, action, type(exc).__name__, exc)


def build_trackers(cfg: RunConfig, run_dir: Path, errors: Counter, *, run_id: str, first_step: int = 1) -> Trackers:
    """The trackers `cfg.logging.report_to` names, opened for a run continuing at `first_step`."""
    require_installed(cfg.logging)
    opened: list[Tracker] = []
    for name in cfg.logging.report_to:
        try:
            if name == "tensorboard":
                logdir = Path(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard_dir else run_dir / "tensorboard"
                opened.append(TensorBoardTracker(logdir, first_step))
            else:
                opened.append(WandbTracker(cfg, run_dir, run_id))
        except Exception as exc:
            Trackers(opened, errors).close()  # a half-opened set leaves no writer or W&B run behind
            raise TrackerUnavailable(f"could not start the {name} tracker: {type(exc).__name__}: {exc}") from exc
    if opened:
        log.info("reporting steps to %s", ", ".join(t.name for t in opened))
    return Trackers(opened, errors)

