"""Tests for samples.jsonl: which completions a step logs (learner/records/samples.py), the file's resume cut-back,
and how `grpo-fleet samples` prints it (observe/samples_view.py, through cli/main.py)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import pytest

from grpo_fleet.cli import main as cli
from grpo_fleet.config import RunConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.records.runlog import SAMPLES_FILE, RunLog, SampleRow
from grpo_fleet.learner.records.samples import SampleLog, extremes_first, pick_samples, sample_rows, samples_due
from grpo_fleet.learner.step.batch import LengthShaping, build_train_batch
from grpo_fleet.observe.samples_view import SamplesRead, format_row, format_samples, read_last_rows, row_from_json, wrapped

RUN_FILES = Path(__file__).resolve().parents[2] / "docs" / "reference" / "run-files.md"
HOSTILE = "\x1b[2J\x1b[31mred\rforged\x00 line\nsecond \\ line"


def _group(name: str, rewards: list[float], version: int = 3) -> AcceptedGroup:
    completions = [CompletionRecord(tokens=np.array([10 + i, 20 + i, 30], np.int32), logprobs=np.full(3, -1.0, np.float32),
                                    reward=r, finish_reason="stop" if i % 2 else "length") for i, r in enumerate(rewards)]
    return AcceptedGroup(group_id=name, prompt_index=7, prompt_tokens=np.array([1, 2], np.int32), completions=completions,
                         policy_version=version, actor_id=f"actor-{name}")


def _decode(tokens: np.ndarray) -> str:
    """A plain, reversible stand-in for a tokenizer's decode: the ids, space-separated."""
    return " ".join(str(int(t)) for t in tokens)


def _row(step: int, completion: str = "olleh", **changes: object) -> SampleRow:
    row = SampleRow(step=step, policy_version=step - 1, group_id=f"g{step}", prompt_index=4, actor_id="mac-1",
                    prompt="reverse: hello\n=", completion=completion, reward=1.0, advantage=0.866,
                    finish_reason="stop", num_tokens=5)
    return replace(row, **changes)


def _config(**train: object) -> RunConfig:
    return RunConfig.model_validate({"train": train})


# ----------------------------------------------------------------- which completions


def test_extremes_first_alternates_best_and_worst_inwards():
    assert extremes_first(np.array([0.1, 0.9, 0.5, 0.0])) == [1, 3, 2, 0]
    assert extremes_first(np.array([0.2, 0.8, 0.5])) == [1, 0, 2]
    assert extremes_first(np.array([1.0, 1.0, 0.0, 0.0])) == [0, 3, 1, 2], "ties keep the actor's order"
    assert extremes_first(np.array([0.5])) == [0]


def test_pick_takes_each_groups_best_and_worst_before_anyones_next():
    groups = [_group("a", [0.0, 1.0, 0.5, 0.2]), _group("b", [0.3, 0.1, 0.9, 0.4]), _group("c", [1.0, 0.0, 0.0, 0.0])]
    assert pick_samples(groups, 4) == [(0, 1), (0, 0), (1, 2), (1, 1)]
    assert pick_samples(groups, 7) == [(0, 1), (0, 0), (1, 2), (1, 1), (2, 0), (2, 3), (0, 2)]
    everything = pick_samples(groups, 100)
    assert len(everything) == 12 and len(set(everything)) == 12, "never more than the batch, never one twice"
    assert pick_samples([], 4) == []


def test_samples_are_due_every_n_steps_and_never_at_zero():
    assert [s for s in range(1, 11) if samples_due(s, 3)] == [3, 6, 9]
    assert not any(samples_due(s, 0) for s in range(1, 11))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_rows_carry_the_decoded_text_and_the_groups_advantage(scale_by_std):
    rewards = [0.0, 1.0, 0.5, 0.25]
    groups = [_group("a", [0.5, 0.5, 0.0, 1.0]), _group("b", rewards, version=5)]
    rows = sample_rows(groups, [(1, 1), (1, 0)], step=9, decode=_decode, scale_by_std=scale_by_std)
    r = np.array(rewards, dtype=np.float64)
    expected = r - r.mean()
    if scale_by_std:
        expected = expected / (r.std() + 1e-4)
    assert [row.advantage for row in rows] == pytest.approx([expected[1], expected[0]], rel=1e-5)
    assert asdict(rows[0]) == {
        "step": 9, "policy_version": 5, "group_id": "b", "prompt_index": 7, "actor_id": "actor-b", "prompt": "1 2",
        "completion": "11 21 30", "reward": 1.0, "advantage": rows[0].advantage, "finish_reason": "stop", "num_tokens": 3,
        "turns": [], "end": "",
    }


@pytest.mark.parametrize("grpo", [{}, {"loss_type": "dr_grpo"}, {"overlong_buffer": 2, "overlong_penalty": 0.5}])
def test_logged_advantages_are_the_ones_the_step_trains_on(tmp_path, grpo):
    """The per-loss-type scale_by_std default and the overlong penalty shape both, the same way."""
    cfg = RunConfig.model_validate({"train": {"log_samples_every": 1, "log_samples_count": 4},
                                    "generation": {"max_tokens": 4}, "grpo": grpo})
    groups = [_group("a", [0.0, 1.0, 0.5, 0.25])]
    first = groups[0].completions[0]  # one completion of max_tokens
    first.tokens, first.logprobs = np.array([10, 20, 30, 40], np.int32), np.full(4, -1.0, np.float32)
    runlog = RunLog(tmp_path)
    SampleLog(cfg, _decode, runlog).after_step(groups, 1)
    runlog.close()
    logged = {(r["completion"]): r["advantage"] for r in map(json.loads, (tmp_path / SAMPLES_FILE).read_text().splitlines())}
    trained = np.array(build_train_batch(groups, scale_by_std=cfg.grpo.scales_by_std,
                                         lengths=LengthShaping.from_config(cfg)).advantages)
    assert [logged[_decode(c.tokens)] for c in groups[0].completions] == pytest.approx(trained.tolist(), rel=1e-6)


def test_a_due_step_appends_its_rows_and_others_append_nothing(tmp_path):
    runlog = RunLog(tmp_path)
    log = SampleLog(_config(log_samples_every=2, log_samples_count=3), _decode, runlog)
    groups = [_group("a", [0.0, 1.0, 0.5, 0.2]), _group("b", [0.3, 0.1, 0.9, 0.4])]
    assert [log.after_step(groups, step) for step in (1, 2, 3, 4)] == [0, 3, 0, 3]
    runlog.close()
    lines = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 2, 2, 4, 4, 4]
    assert [json.loads(line)["group_id"] for line in lines[:3]] == ["a", "a", "b"]


def test_logging_off_writes_nothing(tmp_path):
    runlog = RunLog(tmp_path)
    log = SampleLog(_config(log_samples_every=0), _decode, runlog)
    assert log.after_step([_group("a", [0.0, 1.0])], 10) == 0
    runlog.close()
    assert (tmp_path / SAMPLES_FILE).read_text() == ""


def test_model_output_stays_one_json_line_and_round_trips(tmp_path):
    runlog = RunLog(tmp_path)
    runlog.samples([_row(1, HOSTILE), _row(2)])
    runlog.close()
    lines = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 2 and not re.search(r"[\x00-\x1f]", "".join(lines))
    assert row_from_json(lines[0]) == _row(1, HOSTILE)


# ----------------------------------------------------------------- resume


def test_truncate_cuts_samples_back_with_the_other_logs(tmp_path):
    runlog = RunLog(tmp_path)
    runlog.samples([_row(1)])
    kept = runlog.sizes()
    assert kept.samples_bytes == (tmp_path / SAMPLES_FILE).stat().st_size > 0
    runlog.samples([_row(2), _row(2)])
    runlog.truncate(kept)
    runlog.samples([_row(3)])
    runlog.close()
    assert [json.loads(x)["step"] for x in (tmp_path / SAMPLES_FILE).read_text().splitlines()] == [1, 3]


# ----------------------------------------------------------------- printing


def test_text_is_escaped_line_by_line_wrapped_and_cut():
    lines = wrapped(HOSTILE, width=30, max_chars=1000)
    joined = "\n".join(lines)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", joined), "no control character reaches the terminal"
    assert "\\x1b[31mred\\x0dforged\\x00" in joined.replace("\n    ", "")
    assert "second \\\\ line" in joined, "a backslash of the model's is doubled, so every escape shown is ours"
    assert all(len(line) <= 30 and line.startswith("    ") for line in lines)
    cut = wrapped("abcdefghij", width=80, max_chars=4)
    assert cut == ["    abcd", "    ... (6 more characters)"]


def test_a_row_prints_a_header_then_its_prompt_and_completion():
    text = format_row(_row(12, "olleh", actor_id="mac\x1b[0m-2"), width=80)
    head, *rest = text.split("\n")
    assert head.startswith("step 12  v11  reward 1.000  advantage +0.866  stop  5 tokens  actor mac\\x1b[0m-2")
    assert rest == ["  prompt:", "    reverse: hello", "    =", "  completion:", "    olleh"]
    assert format_row(_row(1, ""), width=80).endswith("  completion:\n    (empty)")
    assert "no samples yet" in format_samples(SamplesRead([], 0))


def test_reading_keeps_the_last_rows_and_skips_a_line_cut_off_mid_write(tmp_path):
    runlog = RunLog(tmp_path)
    runlog.samples([_row(step) for step in range(1, 7)])
    runlog.close()
    with open(tmp_path / SAMPLES_FILE, "a") as handle:
        handle.write(json.dumps(asdict(_row(7)))[:40])  # killed mid-line
    read = read_last_rows(tmp_path, 3)
    assert [row.step for row in read.rows] == [4, 5, 6] and read.skipped == 1
    assert row_from_json(json.dumps({**asdict(_row(1)), "reward": "high"})) is None
    assert row_from_json("[1, 2]") is None


def test_the_cli_prints_the_last_rows_safely(tmp_path, capsys):
    runlog = RunLog(tmp_path)
    runlog.samples([_row(1), _row(2, HOSTILE), _row(3)])
    runlog.close()
    with open(tmp_path / SAMPLES_FILE, "a") as handle:
        handle.write('{"step": 4, "prom')
    assert cli.main(["samples", str(tmp_path), "--last", "2"]) == 0
    captured = capsys.readouterr()
    assert [line.split("  ")[0] for line in captured.out.splitlines() if line.startswith("step")] == ["step 2", "step 3"]
    assert "\\x1b[2J\\x1b[31mred" in captured.out and not re.search(r"[\x00\x0d\x1b]", captured.out)
    assert "skipped 1 incomplete line" in captured.err


def test_the_cli_refuses_a_missing_run_or_file_with_exit_2(tmp_path, capsys):
    assert cli.main(["samples", str(tmp_path / "nowhere")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert cli.main(["samples", str(tmp_path)]) == 2
    assert f"has no {SAMPLES_FILE}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["samples", str(tmp_path), "--last", "0"])
    assert exc.value.code == 2


def test_the_run_files_reference_lists_every_sample_row_key():
    text = RUN_FILES.read_text()
    listed = text[text.index("appends a few lines to `RUN_DIR/samples.jsonl`"):]  # the page's last section
    assert set(re.findall(r"`(\w+)`", listed)) >= {f.name for f in fields(SampleRow)}
