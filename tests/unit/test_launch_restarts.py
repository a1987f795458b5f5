"""launch_policy.py: the launcher's restart decision (pure), and its record of actors it stopped for good."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.exit_codes import DONE, FAILED, NOT_FOUND, REFUSED, is_permanent
from grpo_fleet.launch_policy import (
    BACKOFF_RESET_SECONDS,
    Refusal,
    after_exit,
    format_refusals,
    read_refusals,
    record_refusals,
)


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
    from grpo_fleet.cli import main
    from grpo_fleet.protocol import client
    from grpo_fleet.protocol import messages as m

    answer = m.Status(run_id="run", step=3, steps_target=10, policy_version=3, tokens_per_second=0.0,
                      groups_accepted=6, actors=[])
    monkeypatch.setattr(client, "request_status", lambda *args, **kwargs: answer)
    record_refusals(tmp_path, [Refusal(actor="air-2", host="air-2.local", exit_code=REFUSED, reason="digest mismatch")])
    assert main(["status", "--connect", "tcp://127.0.0.1:5555", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 3/10" in out and "stopped by grpo-fleet launch" in out and "air-2" in out and "digest mismatch" in out
