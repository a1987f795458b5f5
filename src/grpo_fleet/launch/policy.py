"""What `grpo-fleet launch` does about an actor that exited and how long a stopping learner gets (pure), and its
record of actors it stopped for good.

An exit is done, permanent or transient by its code (runtime/exit_codes.py). A transient
one is restarted with an exponential backoff. A done one (the learner said
Shutdown, or someone stopped the actor on its host) is not: the run is over for
it. A permanent one (a refusal) is not restarted either, and is written to
RUN_DIR/launch.json for `grpo-fleet status --run-dir`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.runtime.exit_codes import DONE, is_permanent

FIRST_BACKOFF_SECONDS = 1.0
# An actor that stayed up this long was healthy: its next failure starts the backoff afresh.
BACKOFF_RESET_SECONDS = 60.0
# In the learner's run directory: actors the launcher stopped for good, and why (`grpo-fleet status --run-dir`).
LAUNCH_STATE_FILE = "launch.json"


@dataclass(frozen=True)
class AfterExit:
    """What to do about an actor that exited: restart it in `delay` seconds (then back off to `backoff`), or not."""

    restart: bool
    delay: float
    backoff: float
    finished: bool = False  # not restarted because its run is over, not because it was refused


def after_exit(code: int, ran: float, backoff: float, backoff_max: float) -> AfterExit:
    """The restart decision for an actor that exited with `code` after running `ran` seconds.

    A clean exit (exit_codes.DONE) is not restarted: the learner shut the run
    down, or someone stopped the actor on purpose. A permanent exit
    (exit_codes.PERMANENT: a refusal) is never restarted: it would fail the same
    way each time. Anything else is restarted after
    `backoff`, doubled for the next time up to `backoff_max`; an actor that
    stayed up past BACKOFF_RESET_SECONDS was healthy, so its backoff starts afresh.
    """
    if code == DONE:  # as systemd's Restart=on-failure: a clean exit is never restarted
        return AfterExit(restart=False, delay=0.0, backoff=backoff, finished=True)
    if is_permanent(code):
        return AfterExit(restart=False, delay=0.0, backoff=backoff)
    if ran > BACKOFF_RESET_SECONDS:
        backoff = FIRST_BACKOFF_SECONDS
    delay = min(backoff, backoff_max)
    return AfterExit(restart=True, delay=delay, backoff=min(backoff * 2, backoff_max))


# A stop may land as a step starts: the learner finishes that step, then writes a checkpoint. Twice the
# measured sum allows for a step slower than any seen; the slack is for shutting down (telling the actors,
# joining its threads).
STOP_SAFETY = 2.0
STOP_SLACK_SECONDS = 15.0
RECENT_STEPS = 50  # the metrics.jsonl lines the learner's wait is sized from
TAIL_BYTES = 256 * 1024  # enough for RECENT_STEPS lines; a long run's file is read from there only


@dataclass(frozen=True)
class LearnerStopWait:
    """How long the learner gets after SIGTERM before SIGKILL, and what that was sized from (said in the log)."""

    seconds: float
    reason: str


def learner_stop_wait(records: Sequence[dict[str, Any]], checkpoint_every: int, floor: float) -> LearnerStopWait:
    """The learner's bound after SIGTERM, from its metrics.jsonl lines: it finishes the step in hand, then checkpoints.

    A step takes its `step_seconds` (the slowest of the recent ones). A checkpoint
    takes the wall-clock gap between a checkpointing step's line and the next one,
    less that next step's own time: an upper bound, since the gap also holds any
    wait for rollouts (the median of the gaps seen). Not yet measured, it is taken
    as long as a step. Never less than `floor`, the fleet file's stop_timeout.
    """
    steps = _timed_steps(records)
    if not steps:
        return LearnerStopWait(floor, "stop_timeout; no step of this run measured yet")
    step = max(s.seconds for s in steps)
    gaps = [after.wall - before.wall - after.seconds for before, after in zip(steps, steps[1:])
            if before.step % checkpoint_every == 0 and after.step == before.step + 1]
    checkpoint = max(0.0, statistics.median(gaps)) if gaps else step
    how = "measured" if gaps else "not measured yet, taken as a step"
    needed = STOP_SAFETY * (step + checkpoint) + STOP_SLACK_SECONDS
    sized = (f"its step takes up to {step:.1f}s and a checkpoint {checkpoint:.1f}s ({how}); "
             f"x{STOP_SAFETY:g} + {STOP_SLACK_SECONDS:g}s to shut down")
    if needed <= floor:
        return LearnerStopWait(floor, f"stop_timeout, more than {sized}")
    return LearnerStopWait(needed, sized)


def recent_records(path: Path) -> list[dict[str, Any]]:
    """The last lines of a metrics.jsonl, parsed (none when it does not exist; a torn or foreign line is skipped)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - TAIL_BYTES))
            lines = handle.read().splitlines()[1 if size > TAIL_BYTES else 0:]  # the first may be cut
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass(frozen=True)
class _TimedStep:
    step: int
    seconds: float  # the step's own time
    wall: float  # the run's wall clock when its line was written


def _timed_steps(records: Sequence[dict[str, Any]]) -> list[_TimedStep]:
    """The recent step lines (eval lines and malformed ones left out)."""
    steps = []
    for record in records:
        step, seconds, wall = record.get("step"), _seconds(record.get("step_seconds")), _seconds(record.get("wall_seconds"))
        if "event" not in record and isinstance(step, int) and seconds is not None and wall is not None:
            steps.append(_TimedStep(step, seconds, wall))
    return steps[-RECENT_STEPS:]


def _seconds(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


@dataclass(frozen=True)
class Refusal:
    """An actor stopped for good: its exit code and the reason it gave (its last line)."""

    actor: str
    host: str
    exit_code: int
    reason: str


def record_refusals(run_dir: Path, refusals: list[Refusal]) -> None:
    """Write RUN_DIR/launch.json: the actors stopped for good, for `grpo-fleet status --run-dir` (atomically)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LAUNCH_STATE_FILE
    state = {"refused": [{"actor": r.actor, "host": r.host, "exit_code": r.exit_code, "reason": r.reason}
                         for r in refusals]}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.replace(path)


def read_refusals(run_dir: Path) -> list[Refusal]:
    """The actors `grpo-fleet launch` stopped for good in this run directory (none when it never did)."""
    path = run_dir / LAUNCH_STATE_FILE
    if not path.exists():
        return []
    return [Refusal(**entry) for entry in json.loads(path.read_text()).get("refused", [])]


def format_refusals(refusals: list[Refusal]) -> str:
    """The lines `grpo-fleet status --run-dir` adds: each actor the launcher stopped for good, and why."""
    if not refusals:
        return "\n(no actor stopped by grpo-fleet launch)"
    lines = ["", "stopped by grpo-fleet launch (a permanent refusal: fix it, then launch again):"]
    lines += [f"{r.actor[:24]:<24} {r.host[:20]:<20} exit {r.exit_code:<3} {r.reason}" for r in refusals]
    return "\n".join(lines)
