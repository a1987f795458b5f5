"""`grpo-fleet demo`: a learner and N actors on this machine learn to reverse digits.

Real processes talking ZeroMQ over 127.0.0.1, the tiny self-built model loaded
through mlx_lm, held-out reward measured before and after.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from grpo_fleet.blas import child_env
from grpo_fleet.config import RunConfig, apply_overrides, load_run_config

# The demo's defaults: small enough for 2 CPU cores, tuned so learning is visible
# within a few minutes (lr >= 5e-4 collapsed the tiny model; beta 0.04 keeps groups informative).
DEMO_SETTINGS: dict = {
    "model": {"path": "tiny"},
    "generation": {"group_size": 8, "max_tokens": 5, "temperature": 1.0},
    "task": {"name": "reverse", "digits": 3, "num_train": 800, "num_eval": 128},
    "grpo": {"beta": 0.04, "groups_per_step": 8, "max_staleness": 2},
    "optim": {"lr": 1e-4},
    "train": {"steps": 1500, "checkpoint_every": 250},
    "server": {"max_groups_per_lease": 4, "lease_seconds": 30.0},
}


@dataclass
class DemoOptions:
    actors: int = 2
    steps: Optional[int] = None
    run_dir: str = "runs/demo"
    progress: bool = True
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def demo_config(options: DemoOptions) -> RunConfig:
    """Demo defaults, then the user's config file, then --set overrides and flags."""
    base = DEMO_SETTINGS if options.config is None else {}
    cfg = load_run_config(options.config, []) if options.config else None
    data = base if cfg is None else cfg.model_dump(mode="json")
    port = free_port()
    flags = [f'run_dir="{Path(options.run_dir).resolve()}"', f'server.bind="tcp://127.0.0.1:{port}"',
             f'server.pub_bind="tcp://127.0.0.1:{free_port()}"', f"metrics.port={free_port()}"]
    if options.steps is not None:
        flags.append(f"train.steps={options.steps}")
    return RunConfig.model_validate(apply_overrides(data, options.overrides + flags))


def fleet_env() -> dict:
    """Environment for processes that share this machine: OpenBLAS, one BLAS thread each.

    Learner and actors already keep every core busy; BLAS threads on top of that
    oversubscribe the CPU (measured: 500 demo steps took 49 s with OpenBLAS's
    default threads and 37 s with one per process on 2 cores).
    """
    env = child_env()
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_fleet", *args], stdout=log, stderr=subprocess.STDOUT,
        env=fleet_env(), start_new_session=True,
    )


def start_fleet(cfg: RunConfig, config_path: Path, actors: int) -> tuple[subprocess.Popen, list[subprocess.Popen], list[int]]:
    """Start the learner and `actors` actor processes; returns them and the actors' metrics ports."""
    run_dir = Path(cfg.run_dir)
    learner = _spawn(["learner", "--config", str(config_path)], run_dir / "learner.log")
    ports = [free_port() for _ in range(actors)]
    fleet = [
        _spawn(["actor", "--connect", cfg.server.bind, "--actor-id", f"demo-actor-{i}", "--metrics-port", str(port),
                "--max-groups", str(cfg.server.max_groups_per_lease), "--model-dir", str(run_dir)],
               run_dir / f"actor-{i}.log")
        for i, port in enumerate(ports)
    ]
    return learner, fleet, ports


def stop(processes: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL whatever is left; only our own processes."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in processes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def follow(learner: subprocess.Popen, cfg: RunConfig, progress: bool) -> list[dict]:
    """Wait for the learner to finish, showing a progress bar fed by metrics.jsonl."""
    from tqdm import tqdm

    from grpo_fleet.plotting import load_step_records

    path = Path(cfg.run_dir) / "metrics.jsonl"
    bar = tqdm(total=cfg.train.steps, desc="training", unit="step", disable=not progress, file=sys.stdout)
    seen = 0
    while True:
        records = load_step_records(path)
        if len(records) > seen:
            bar.update(len(records) - seen)
            seen = len(records)
            last = records[-1]
            bar.set_postfix(reward=f"{last['reward_mean']:.3f}", kl=f"{last['kl']:.4f}", v=last["policy_version"])
        if learner.poll() is not None:
            break
        time.sleep(0.5)
    bar.close()
    return load_step_records(path)


def held_out_reward(model_or_checkpoint: str, cfg: RunConfig) -> float:
    """Greedy held-out reward of a model directory or a checkpoint."""
    from grpo_fleet.evaluate import evaluate
    from grpo_fleet.model import cast_floating, default_dtype, load_checkpoint
    from grpo_fleet.tasks import build_task

    model, tokenizer = load_checkpoint(model_or_checkpoint)
    if default_dtype():
        cast_floating(model, default_dtype())
    return evaluate(model, tokenizer, build_task(cfg.task), cfg)


def run_demo(options: DemoOptions) -> dict:
    """Build the tiny model, measure, train with a real fleet, measure again, summarise."""
    from grpo_fleet.learner.setup import resolve_model_path
    from grpo_fleet.model import latest_checkpoint
    from grpo_fleet.tasks import build_task

    started = time.monotonic()
    cfg = demo_config(options)
    run_dir = Path(cfg.run_dir)
    for stale in ("metrics.jsonl", "ledger.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg, build_task(cfg.task))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
    config_path = run_dir / "demo-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    before = held_out_reward(model_path, cfg)
    print(f"held-out reward before training: {before:.3f}  ({len(build_task(cfg.task).eval)} prompts)")
    learner, actors, actor_ports = start_fleet(cfg, config_path, options.actors)
    print(f"learner on {cfg.server.bind}, metrics http://127.0.0.1:{cfg.metrics.port}/metrics; "
          f"actors' metrics on ports {actor_ports}; logs in {run_dir}")
    try:
        records = follow(learner, cfg, options.progress)
    finally:
        stop([learner, *actors])
    checkpoint = latest_checkpoint(run_dir)
    if learner.returncode != 0 or checkpoint is None:
        print(f"the learner failed (exit {learner.returncode}); see {run_dir / 'learner.log'}")
        return {"ok": False}
    after = held_out_reward(str(checkpoint), cfg)
    return summarise(cfg, records, before, after, time.monotonic() - started, checkpoint)


def summarise(cfg: RunConfig, records: list[dict], before: float, after: float, wall: float, checkpoint: Path) -> dict:
    from grpo_fleet.plotting import plot_run

    run_dir = Path(cfg.run_dir)
    plot = run_dir / "curves.png"
    summary = {
        "eval_reward_before": before,
        "eval_reward_after": after,
        "steps": records[-1]["step"] if records else 0,
        "policy_version": records[-1]["policy_version"] if records else 0,
        "wall_seconds": wall,
        "train_seconds": records[-1]["wall_seconds"] if records else 0.0,
        "checkpoint": str(checkpoint),
        "plot": str(plot),
        # The demo's claim is that the fleet learns: no steps, or no rise in held-out reward, is a failure.
        "ok": bool(records) and after > before,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if records:
        plot_run(run_dir, plot)  # after summary.json: it draws the held-out before/after from there
    print(f"held-out reward: {before:.3f} -> {after:.3f} in {summary['steps']} steps, {wall:.0f}s wall")
    print(f"summary {run_dir / 'summary.json'}, plot {plot}, checkpoint {checkpoint}")
    if not summary["ok"]:
        print("the held-out reward did not rise: the demo did not show learning (too few steps?)")
    return summary
