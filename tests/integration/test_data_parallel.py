"""The data-parallel learner on 127.0.0.1 over MLX's ring backend: 2 ranks train what 1 does; a lost or stopped
rank ends rank 0 non-zero with no partial checkpoint; the run resumes on 1 rank and stays exactly-once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.learner.records.persistence import read_state
from grpo_fleet.models.loading import latest_checkpoint
from grpo_fleet.runtime.blas import child_env
from grpo_fleet.runtime.exit_codes import RANKS_FAILED
from helpers import audit_ledger, finished_in_checkpoint, free_port_pair, jsonl, scrape, wait_steps

DRIVER = Path(__file__).parents[1] / "data_parallel_driver.py"
STEPS = 3
TOLERANCE = 1e-5


def _two_ranks(args: list[str], tmp_path: Path, timeout: float) -> str:
    """Two ranks of `python ARGS` on a loopback ring, started as mlx.launch starts them (MLX_HOSTFILE, MLX_RANK) but
    without it: mlx.launch spins a core for as long as its ranks run (docs/data-parallel.md). Each rank's process
    group is killed if it overruns; returns both logs."""
    hostfile = tmp_path / "ranks.json"
    port = free_port_pair()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs, logs = [], [tmp_path / f"rank{rank}.log" for rank in range(2)]
    for rank, log in enumerate(logs):
        env = child_env({**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)})
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-3000:]
    return text


def _differences(one: dict[str, mx.array], two: dict[str, mx.array]) -> tuple[float, float, float, float]:
    """(max |a - b|, that over max |a| of all weights, the worst per-weight relative figure, how far a moved)."""
    names = [k for k in one if not k.startswith("init.")]
    assert names and set(names) == {k for k in two if not k.startswith("init.")}
    diff = {k: float(np.abs(np.array(one[k]) - np.array(two[k])).max()) for k in names}
    size = {k: float(np.abs(np.array(one[k])).max()) for k in names}
    moved = max(float(np.abs(np.array(one[k]) - np.array(one[f"init.{k}"])).max()) for k in names)
    worst = max(diff.values())
    return worst, worst / max(size.values()), max(diff[k] / max(size[k], 1e-12) for k in names), moved


def test_two_ranks_train_the_same_weights_as_one_for_every_loss_lora_and_full(tiny_model_dir: Path, tmp_path: Path):
    single, ranks = tmp_path / "one", tmp_path / "two"
    env = child_env()
    subprocess.run([sys.executable, str(DRIVER), str(tiny_model_dir), str(single), str(STEPS)], env=env, check=True,
                   timeout=300, start_new_session=True)
    output = _two_ranks([str(DRIVER), str(tiny_model_dir), str(ranks), str(STEPS)], tmp_path, timeout=480)
    assert "rank 1: done" in output and "rank 0: done" in output
    names = sorted(p.stem for p in single.glob("*.safetensors"))
    assert len(names) == 10  # 5 objectives (4 loss types + decoupled at 2 epochs) x LoRA and full
    for name in names:
        one, two = mx.load(str(single / f"{name}.safetensors")), mx.load(str(ranks / f"{name}.safetensors"))
        worst, relative, per_weight, moved = _differences(one, two)  # type: ignore[arg-type]
        print(f"{name}: max |diff| {worst:.2e}, relative {relative:.2e} (worst weight {per_weight:.2e}), "
              f"weights moved up to {moved:.2e}")
        assert moved > 10 * TOLERANCE, "the steps trained something"
        assert worst <= TOLERANCE and relative <= TOLERANCE, name
        stats_one = json.loads((single / f"{name}.json").read_text())
        stats_two = json.loads((ranks / f"{name}.json").read_text())
        assert len(stats_one) == len(stats_two) == STEPS
        for a, b in zip(stats_one, stats_two):
            for key, value in a.items():
                want = value if value is None or isinstance(value, (int, str)) else pytest.approx(value, rel=1e-4, abs=1e-5)
                assert b[key] == want, (name, key)
    _older_groups_are_checked_by_the_ranks_that_train_them(single, ranks, output)


def _older_groups_are_checked_by_the_ranks_that_train_them(single: Path, ranks: Path, output: str) -> None:
    """The driver's last steps recompute older groups inside the step: 2 ranks judge as 1 process does, rank 1
    recomputes its own rows of them (its /metrics counter), and the lie in its rows drops the step on both."""
    one, two = (json.loads((run / "recheck.json").read_text()) for run in (single, ranks))
    want = [[[0, None], [1, None]], [[0, None], [1, "token"]]]
    assert [s["rechecked"] for s in one] == [s["rechecked"] for s in two] == want
    assert [s["skipped"] for s in two] == [None, "logprob_mismatch"] and [s["unchanged"] for s in two] == [False, True]
    assert [s["recomputed_rows"] for s in one] == [6, 6] and [s["recomputed_rows"] for s in two] == [3, 3]
    assert "rank 1: recomputed 6 completions" in output, output[-2000:]
    assert all(s["check_seconds"] > 0 for s in two)


def _hostfile(tmp_path: Path, free_port) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    return path


def _rank_env(hostfile: Path, rank: int) -> dict[str, str]:
    return {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}


def test_a_rank_alone_gives_up_connecting_with_a_clear_message(run_config, spawn, tmp_path, free_port):
    config, _ = run_config(distributed={"idle_timeout_seconds": 3})
    alone = spawn("learner", "--config", str(config), name="rank0", env=_rank_env(_hostfile(tmp_path, free_port), 0))
    code = alone.wait(timeout=60)
    log = alone.log_path.read_text()  # type: ignore[attr-defined]
    assert code != 0, log[-2000:]
    assert "rank 0: connecting to the other ranks" in log and "giving up after 3 s" in log
    assert "Timeout" in log, log[-2000:]  # faulthandler's stack dump, showing where it waited


def _start_fleet(run_config, spawn, tmp_path, free_port, **sections):
    """A 2-rank learner (ranks started by hand, as mlx.launch would) and 2 actors; returns them and the run dir."""
    config, cfg = run_config(
        generation={"max_tokens": 5}, task={"num_train": 100},
        server={"lease_seconds": 5.0, "heartbeat_seconds": 0.5}, **sections)
    hostfile = _hostfile(tmp_path, free_port)
    rank0 = spawn("learner", "--config", str(config), name="rank0", env=_rank_env(hostfile, 0))
    rank1 = spawn("learner", "--config", str(config), name="rank1", env=_rank_env(hostfile, 1))
    run_dir = Path(cfg.run_dir)
    actors = [spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"dp-{i}", "--metrics-port", "0",
                    "--request-timeout", "3", "--model-dir", str(run_dir), name=f"actor{i}")
              for i in range(2)]
    return rank0, rank1, actors, run_dir


def _both_ranks_export_their_collectives(port: int) -> None:
    """Rank 0 with the learner's metrics, rank 1 on port + 1: collective seconds and bytes, and rank 1's steps."""
    rank0, rank1 = scrape(port), scrape(port + 1)
    for page, rank in ((rank0, "0"), (rank1, "1")):
        assert page.value("grpo_fleet_learner_collective_seconds_total", rank=rank) > 0, page.text[:2000]
        assert page.value("grpo_fleet_learner_collective_bytes_total", rank=rank,
                          collective="gradient all-sum") > 0, page.text[:2000]
    assert rank1.value("grpo_fleet_learner_rank_steps_total", rank="1") >= 1
    assert rank1.value("grpo_fleet_learner_rank_step_seconds_count", rank="1") >= 1
    assert rank1.value("grpo_fleet_learner_steps_total") == 0, "rank 1 serves its own page, not the learner's"
    # Rank 1 slept on rank 0's doorbell for each command (the run config and every step at least).
    assert rank1.value("grpo_fleet_learner_rank_doorbell_waits_total", rank="1", result="rang") >= 6, rank1.text[:3000]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _a_waiting_follower_sleeps(rank1: subprocess.Popen, seconds: float = 4.0) -> None:
    """Once rank 1 is ready and rank 0 idles, rank 1 sleeps on rank 0's doorbell: without it, MLX's ring spun a
    core for a fifth of the time at least (the share of each keepalive gap the follower did not sleep)."""
    deadline = time.monotonic() + 120
    while "waiting for rank 0's batches" not in rank1.log_path.read_text():  # type: ignore[attr-defined]
        assert rank1.poll() is None and time.monotonic() < deadline, rank1.log_path.read_text()[-2000:]  # type: ignore[attr-defined]
        time.sleep(0.2)
    if not sys.platform.startswith("linux"):
        return  # /proc
    before = _cpu_seconds(rank1.pid)
    time.sleep(seconds)
    used = _cpu_seconds(rank1.pid) - before
    assert used < 0.05 * seconds, f"rank 1 used {used:.2f} CPU s of {seconds:g} s waiting for rank 0's next command"


def _no_partial_checkpoint(run_dir: Path, steps_done: int) -> None:
    root = run_dir / "checkpoints"
    staging = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert staging == [], f"half-written checkpoints left behind: {staging}"
    latest = latest_checkpoint(run_dir)
    assert latest is not None and read_state(latest)["step"] <= steps_done


@pytest.mark.slow
def test_a_killed_rank_ends_rank0_cleanly_and_the_run_resumes_on_one_rank(run_config, spawn, tmp_path, free_port):
    target = 14
    port = free_port_pair()  # rank 1 serves its metrics on the learner's port + 1
    rank0, rank1, actors, run_dir = _start_fleet(
        run_config, spawn, tmp_path, free_port, train={"steps": target, "checkpoint_every": 3}, metrics={"port": port})
    wait_steps(run_dir, 5, rank0, timeout=240)
    _both_ranks_export_their_collectives(port)
    os.killpg(rank1.pid, signal.SIGKILL)
    rank1.wait()
    code = rank0.wait(timeout=120)
    log = rank0.log_path.read_text()
    assert code == RANKS_FAILED, log[-3000:]
    assert "rank 1 is gone" in log and "exiting without a checkpoint" in log, log[-3000:]
    done = len(jsonl(run_dir / "metrics.jsonl"))
    assert done < target, "the run had not finished when rank 1 died"
    _no_partial_checkpoint(run_dir, done)
    assert all(actor.poll() is None for actor in actors), "actors keep retrying while no learner answers"

    resumed = spawn("learner", "--resume", str(run_dir), name="resumed")  # one rank: the plain learner
    assert resumed.wait(timeout=300) == 0, resumed.log_path.read_text()[-3000:]
    for actor in actors:
        assert actor.wait(timeout=30) == 0, "the actors reconnected to the resumed learner and were told to stop"
    assert [r["step"] for r in jsonl(run_dir / "metrics.jsonl")] == list(range(1, target + 1))
    audit = audit_ledger(run_dir / "ledger.jsonl")  # each group accepted once, dropped at most once after that
    state = read_state(latest_checkpoint(run_dir))["scheduler"]  # type: ignore[arg-type]
    assert set(audit.accepted) == finished_in_checkpoint(state)


@pytest.mark.slow
def test_the_watchdog_ends_rank0_when_a_rank_is_stopped(run_config, spawn, tmp_path, free_port):
    rank0, rank1, actors, run_dir = _start_fleet(
        run_config, spawn, tmp_path, free_port,
        train={"steps": 100000, "checkpoint_every": 2}, distributed={"timeout_seconds": 8, "keepalive_seconds": 0.5})
    wait_steps(run_dir, 3, rank0, timeout=240)
    os.killpg(rank1.pid, signal.SIGSTOP)
    try:
        code = rank0.wait(timeout=90)
    finally:
        os.killpg(rank1.pid, signal.SIGKILL)
        rank1.wait()
    log = rank0.log_path.read_text()
    assert code == RANKS_FAILED, log[-3000:]
    assert "did not finish within 8 s" in log and "exiting without a checkpoint" in log, log[-3000:]
    _no_partial_checkpoint(run_dir, len(jsonl(run_dir / "metrics.jsonl")))


@pytest.mark.slow
def test_a_one_rank_run_resumes_on_two_ranks_and_both_stop_cleanly_at_the_end(run_config, spawn, tmp_path, free_port):
    config, cfg = run_config(generation={"max_tokens": 5}, task={"num_train": 100}, train={"steps": 4})
    run_dir = Path(cfg.run_dir)

    def actors(tag: str) -> list:
        # The same two actors (ids) both times, as the same Macs would be: the leases the first learner had out
        # at its last checkpoint are handed out again when they say Hello, not after a 60 s lease deadline.
        return [spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"dp-{i}", "--metrics-port", "0",
                      "--request-timeout", "3", "--model-dir", str(run_dir), name=f"{tag}{i}") for i in range(2)]

    single = spawn("learner", "--config", str(config), name="single")
    first = actors("first")
    assert single.wait(timeout=240) == 0, single.log_path.read_text()[-3000:]
    assert all(actor.wait(timeout=30) == 0 for actor in first)

    hostfile = _hostfile(tmp_path, free_port)
    resume = ("learner", "--resume", str(run_dir), "--set", "train.steps=8")
    rank0 = spawn(*resume, name="rank0", env=_rank_env(hostfile, 0))
    rank1 = spawn(*resume, name="rank1", env=_rank_env(hostfile, 1))
    _a_waiting_follower_sleeps(rank1)  # rank 0 has no actors yet: it waits for a batch
    second = actors("second")
    assert rank0.wait(timeout=300) == 0, rank0.log_path.read_text()[-3000:]
    assert rank1.wait(timeout=60) == 0, rank1.log_path.read_text()[-3000:]
    assert "rank 1: rank 0 says stop after 4 steps" in rank1.log_path.read_text()
    assert all(actor.wait(timeout=30) == 0 for actor in second)
    assert [r["step"] for r in jsonl(run_dir / "metrics.jsonl")] == list(range(1, 9))
    audit = audit_ledger(run_dir / "ledger.jsonl")
    assert set(audit.accepted) == finished_in_checkpoint(read_state(latest_checkpoint(run_dir))["scheduler"])  # type: ignore[arg-type]
