"""grpo_fleet.observe.plotting.plot_run: curves of a run directory as a PNG."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import pytest

from grpo_fleet.observe.plotting import RunDataError, plot_run, read_step_records, throughput

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_record(step: int, wall: float, rng: random.Random) -> dict:
    """A line as `Learner._step_record` writes it."""
    progress = step / 300
    return {
        "step": step, "policy_version": step, "reward_mean": min(1.0, 0.05 + 0.8 * progress + rng.uniform(-0.05, 0.05)),
        "reward_std": 0.2, "loss": rng.uniform(-0.1, 0.1), "kl": 0.02 * progress + rng.uniform(0, 0.002),
        "clip_fraction": rng.uniform(0, 0.05), "grad_norm": 1.0, "groups": 8, "tokens": 8 * 8 * 5,
        "staleness_mean": rng.choice([0.0, 0.5, 1.0, 1.25]), "zero_variance_fraction": 0.1,
        "step_seconds": 0.05, "wall_seconds": wall, "actors": 2,
    }


def write_run(run_dir: Path, steps: int = 300, summary: bool = True) -> Path:
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    wall, lines = 0.0, []
    for step in range(1, steps + 1):
        wall += rng.uniform(0.08, 0.15)
        lines.append(json.dumps(step_record(step, wall, rng)))
    if summary:  # eval rounds at the start and the end, among the step lines as the learner writes them
        for step, reward in ((0, 0.04), (steps, 0.85)):
            lines.insert(step, json.dumps({"event": "eval", "step": step, "eval_reward": reward,
                                           "eval_pass_at_k": reward, "k": 1}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.json").write_text(json.dumps({"grpo": {"max_staleness": 2}}))
    return run_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 1100)
    assert 20_000 < len(data) < 5_000_000


def test_default_output_is_run_dir_curves_png(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    out = plot_run(run)
    assert out == run / "curves.png"
    assert_png(out)


def test_off_policy_and_length_panels_draw_from_their_keys(tmp_path: Path) -> None:
    """Records with the off-policy and length keys, and a truncated old run without them, both render."""
    run = write_run(tmp_path / "run", steps=40)
    rng = random.Random(1)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.update(offpolicy_gap_mean=rng.uniform(0.01, 0.1), offpolicy_gap_max=rng.uniform(0.5, 3.0),
                      is_capped_fraction=rng.uniform(0, 0.05), ratio_mean=1.0, completion_length_mean=rng.uniform(3, 5),
                      completion_length_max=5.0, truncated_fraction=rng.uniform(0.2, 0.9))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.json").write_text(json.dumps({"grpo": {"max_staleness": 2, "objective": "decoupled"}}))
    with_keys = plot_run(run, tmp_path / "with.png")
    assert_png(with_keys)
    without = plot_run(write_run(tmp_path / "old", steps=40), tmp_path / "without.png")
    assert_png(without)
    assert with_keys.read_bytes() != without.read_bytes()


def test_explicit_output_and_no_summary(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=12, summary=False)
    out = plot_run(run, tmp_path / "plots" / "x.png")
    assert out == tmp_path / "plots" / "x.png"
    assert_png(out)


def test_single_step_run(tmp_path: Path) -> None:
    assert_png(plot_run(write_run(tmp_path / "run", steps=1)))


def test_missing_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDataError, match="metrics.jsonl not found"):
        plot_run(tmp_path)
    assert not (tmp_path / "curves.png").exists()


def test_empty_metrics_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(RunDataError, match="no step records"):
        plot_run(tmp_path)


def test_partial_last_line_of_a_live_run_is_skipped(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=5)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "rew')
    assert [r["step"] for r in read_step_records(run)] == [1, 2, 3, 4, 5]
    (run / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(RunDataError, match=":1: not JSON"):
        read_step_records(run)


def test_throughput_uses_wall_clock_deltas() -> None:
    records = [
        {"step": 1, "tokens": 100, "step_seconds": 0.5, "wall_seconds": 10.0},
        {"step": 2, "tokens": 100, "step_seconds": 0.5, "wall_seconds": 12.0},
        {"step": 3, "tokens": 300, "step_seconds": 1.0, "wall_seconds": 11.0},  # clock went back: undefined
        {"step": 4, "tokens": 300, "step_seconds": 1.0, "wall_seconds": 14.0},
        {"step": 5, "step_seconds": 1.0, "wall_seconds": 15.0},  # no tokens: no point, but the clock moves on
        {"step": 6, "tokens": 100, "step_seconds": 0.0, "wall_seconds": 16.0},
    ]
    steps, fleet, trainer = throughput(records)
    assert steps == [1, 2, 3, 4, 6]
    assert [None if math.isnan(v) else v for v in fleet] == [None, 50.0, None, 100.0, 100.0]
    assert [None if math.isnan(v) else v for v in trainer] == [200.0, 200.0, 300.0, 300.0, None]
