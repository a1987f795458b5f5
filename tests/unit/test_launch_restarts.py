"""launch/policy.py: the launcher's restart decision and the learner's stop wait (pure), and its record of actors it
stopped for good."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_fleet.launch.policy import (
    BACKOFF_RESET_SECONDS,
    STOP_SAFETY,
    STOP_SLACK_SECONDS,
    TAIL_BYTES,
    Refusal,
    after_exit,
    format_refusals,
    learner_stop_wait,
    read_refusals,
    recent_records,
    record_refusals,
)
from grpo_fleet.runtime.exit_codes import DONE, FAILED, NOT_FOUND, REFUSED, is_permanent


@pytest.mark.parametrize("code", [REFUSED, NOT_FOUND, 126])
def test_a_permanent_exit_is_never_restarted(code: int) -> None:
    decision = after_exit(code, ran=0.5, backoff=4.0, backoff_max=30.0)
    assert not decision.restart and not decision.finished and is_permanent(code)


def test_a_clean_exit_is_finished_not_restarted_and_not_a_refusal() -> None:
    decision = after_exit(DONE, ran=0.5, backoff=4.0, backoff_max=30.0)
    assert (decision.restart, decision.finished) == (False, True) and not is_permanent(DONE)


@pytest.mark.parametrize("code", [FAILED, 255, 130, 143])  # a crash, ssh's failure, SIGINT, SIGTERM
def test_a_transient_exit_is_restarted_with_a_doubling_backoff(code: int) -> None:
    first = after_exit(code, ran=0.5, backoff=1.0, backoff_max=3.0)
    second = after_exit(code, ran=0.5, backoff=first.backoff, backoff_max=3.0)
    third = after_exit(code, ran=0.5, backoff=second.backoff, backoff_max=3.0)
    assert (first.restart, second.restart, third.restart) == (True, True, True) and not first.finished
    assert [first.delay, second.delay, third.delay] == [1.0, 2.0, 3.0], "doubling, capped at backoff_max"


def test_an_actor_that_was_healthy_starts_its_backoff_afresh() -> None:
    decision = after_exit(FAILED, ran=BACKOFF_RESET_SECONDS + 1, backoff=16.0, backoff_max=30.0)
    assert decision.restart and decision.delay == 1.0 and decision.backoff == 2.0


def test_refusals_are_recorded_in_the_run_dir_for_status(tmp_path: Path) -> None:
    assert read_refusals(tmp_path) == [] and "no actor stopped" in format_refusals([])
    refused = Refusal(actor="air-2", host="me@air-2.local", exit_code=REFUSED,
                      reason="grpo-fleet actor: refusing to run: local copy of m differs from the learner's (digest mismatch)")
    record_refusals(tmp_path / "run", [refused])
    assert read_refusals(tmp_path / "run") == [refused]
    shown = format_refusals([refused])
    assert "air-2" in shown and "exit 2" in shown and "digest mismatch" in shown


def test_status_with_a_run_dir_lists_the_actors_launch_stopped(tmp_path: Path, monkeypatch, capsys) -> None:
    from grpo_fleet.cli.main import main
    from grpo_fleet.protocol import client
    from grpo_fleet.protocol import messages as m

    answer = m.Status(run_id="run", step=3, steps_target=10, policy_version=3, tokens_per_second=0.0,
                      groups_accepted=6, actors=[])
    monkeypatch.setattr(client, "request_status", lambda *args, **kwargs: answer)
    record_refusals(tmp_path, [Refusal(actor="air-2", host="air-2.local", exit_code=REFUSED, reason="digest mismatch")])
    assert main(["status", "--connect", "tcp://127.0.0.1:5555", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 3/10" in out and "stopped by grpo-fleet launch" in out and "air-2" in out and "digest mismatch" in out


def _steps(seconds: list[float], checkpoint_every: int, checkpoint: float, wait: float = 0.0) -> list[dict]:
    """metrics.jsonl step lines: each step's own time, and the wall clock moving by it, by a checkpoint after
    each checkpointing step, and by `wait` for rollouts before each step."""
    wall, lines = 0.0, []
    for step, own in enumerate(seconds, start=1):
        wall += wait + own
        lines.append({"step": step, "step_seconds": own, "wall_seconds": wall, "loss": 0.1})
        if step % checkpoint_every == 0:
            wall += checkpoint
    return lines


def test_the_learner_wait_is_sized_from_its_measured_step_and_checkpoint() -> None:
    # A real model: 20 s steps and 12 s checkpoints, every 2 steps, eval lines in between.
    lines = _steps([18.0, 20.0, 19.0, 17.0, 20.0], checkpoint_every=2, checkpoint=12.0)
    lines.insert(2, {"event": "eval", "step": 2, "seconds": 300.0})
    wait = learner_stop_wait(lines, checkpoint_every=2, floor=30.0)
    assert wait.seconds == pytest.approx(STOP_SAFETY * (20.0 + 12.0) + STOP_SLACK_SECONDS)
    assert "step takes up to 20.0s" in wait.reason and "checkpoint 12.0s (measured)" in wait.reason


def test_a_checkpoint_not_yet_seen_is_taken_as_long_as_a_step_and_the_floor_holds() -> None:
    unmeasured = learner_stop_wait(_steps([40.0], checkpoint_every=100, checkpoint=0.0), 100, floor=30.0)
    assert unmeasured.seconds == pytest.approx(STOP_SAFETY * 80.0 + STOP_SLACK_SECONDS)
    assert "not measured yet" in unmeasured.reason
    tiny = learner_stop_wait(_steps([0.05] * 9, checkpoint_every=3, checkpoint=0.01), 3, floor=30.0)
    assert tiny.seconds == 30.0 and tiny.reason.startswith("stop_timeout, more than")
    assert learner_stop_wait([], 10, floor=30.0).seconds == 30.0  # no step yet: the fleet file's stop_timeout


def test_waiting_for_rollouts_never_makes_the_learner_wait_shorter() -> None:
    # A starved learner: the gap after a checkpoint also holds the wait, so the bound errs long, never short.
    starved = learner_stop_wait(_steps([20.0] * 6, checkpoint_every=1, checkpoint=12.0, wait=5.0), 1, floor=1.0)
    assert starved.seconds >= STOP_SAFETY * (20.0 + 12.0) + STOP_SLACK_SECONDS


def test_the_learner_wait_reads_only_the_tail_of_a_long_metrics_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    old = _steps([1.0] * 20000, checkpoint_every=10, checkpoint=1.0)
    recent = [{**line, "step": line["step"] + 20000, "wall_seconds": line["wall_seconds"] + 1e5}
              for line in _steps([30.0] * 60, checkpoint_every=10, checkpoint=10.0)]
    path.write_text("".join(json.dumps(line) + "\n" for line in old + recent) + '{"step": 20061, "step_sec')  # torn
    records = recent_records(path)
    assert path.stat().st_size > 2 * TAIL_BYTES and len(records) < len(old)
    wait = learner_stop_wait(records, checkpoint_every=10, floor=30.0)
    assert wait.seconds == pytest.approx(STOP_SAFETY * (30.0 + 10.0) + STOP_SLACK_SECONDS)
    assert recent_records(tmp_path / "missing.jsonl") == []
