"""What `grpo-fleet launch` does about an actor that exited (pure), and its record of actors it stopped for good.

An exit is done, permanent or transient by its code (exit_codes.py). A transient
one is restarted with an exponential backoff. A done one (the learner said
Shutdown, or someone stopped the actor on its host) is not: the run is over for
it. A permanent one (a refusal) is not restarted either, and is written to
RUN_DIR/launch.json for `grpo-fleet status --run-dir`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grpo_fleet.exit_codes import DONE, is_permanent

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
