"""Benchmark 4: wall time to the demo's target held-out reward, fleet against a synchronous loop.

Both runs use the demo's model, task and hyperparameters. The baseline is one
process in which rollouts and updates take turns, as in the seed notebook. Both
keep a snapshot every `EVAL_EVERY` steps with the wall time since launch
(process start included); snapshots are evaluated afterwards, so evaluation never
slows either run. Time to target = the first snapshot whose held-out reward
reaches it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.actor.rollout import SamplingSettings, completion_text, generate_groups
from grpo_fleet.bench import Figure, Report
from grpo_fleet.config import RunConfig
from grpo_fleet.demo import DemoOptions, demo_config, held_out_reward, start_fleet, stop
from grpo_fleet.evaluate import evaluate
from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord, build_train_batch
from grpo_fleet.learner.scheduler import PromptScheduler
from grpo_fleet.learner.setup import resolve_model_path, tokenize_prompts
from grpo_fleet.learner.trainer import Trainer
from grpo_fleet.model import load_policy, trainable_weights
from grpo_fleet.tasks import build_task

EVAL_EVERY = 100


def _config(root: Path, steps: int) -> RunConfig:
    cfg = demo_config(DemoOptions(run_dir=str(root / "fleet"), steps=steps, progress=False))
    train = cfg.train.model_copy(update={"checkpoint_every": EVAL_EVERY, "keep_checkpoints": steps // EVAL_EVERY + 2})
    return cfg.model_copy(update={"train": train})


def fleet_curve(cfg: RunConfig, actors: int = 2) -> list[tuple[int, float, float]]:
    """(step, seconds since launch, held-out reward) for each checkpoint of a learner + `actors` run."""
    run_dir = Path(cfg.run_dir)
    config_path = run_dir / "bench-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    launched = time.time()
    learner, fleet, _ = start_fleet(cfg, config_path, actors)
    try:
        learner.wait(timeout=1800)
    finally:
        stop([learner, *fleet])
    curve = []
    for checkpoint in sorted((run_dir / "checkpoints").glob("step_*")):
        meta = json.loads((checkpoint / "grpo_fleet.json").read_text())
        written = os.path.getmtime(checkpoint / "grpo_fleet.json") - launched
        curve.append((meta["step"], written, held_out_reward(str(checkpoint), cfg)))
    return curve


def _sampled_groups(policy, prompts, tickets, settings, task) -> list[AcceptedGroup]:
    eos = set(policy.tokenizer.eos_token_ids)
    generated = generate_groups(policy.model, [prompts[t.prompt_index] for t in tickets], settings)
    groups = []
    for ticket, completions in zip(tickets, generated):
        fields = task.fields(task.train[ticket.prompt_index])
        records = [
            CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32),
                             task.score(completion_text(policy.tokenizer, c, eos), fields), c.finish_reason)
            for c in completions
        ]
        groups.append(AcceptedGroup(ticket.group_id, ticket.prompt_index, prompts[ticket.prompt_index], records, 0, "sync"))
    return groups


def sync_curve(cfg: RunConfig, model_path: str) -> list[tuple[int, float, float]]:
    """The baseline: generate a batch, train on it, repeat, in one process."""
    launched = time.time()
    policy = load_policy(model_path, dtype=cfg.model.dtype)
    reference = load_policy(model_path, dtype=cfg.model.dtype).model if cfg.grpo.beta > 0 else None
    trainer = Trainer(policy, cfg.grpo, cfg.optim, temperature=cfg.generation.temperature,
                      max_tokens=cfg.generation.max_tokens, ref_model=reference, compile=cfg.train.compile)
    task = build_task(cfg.task)
    prompts = tokenize_prompts(policy.tokenizer, task, cfg)
    scheduler = PromptScheduler(len(prompts), seed=cfg.train.seed, lease_seconds=1e9)
    gen = cfg.generation
    settings = SamplingSettings(gen.group_size, gen.max_tokens, gen.temperature, gen.top_p, sorted(policy.tokenizer.eos_token_ids))
    snapshots = []
    for step in range(1, cfg.train.steps + 1):
        batch: list[AcceptedGroup] = []
        while len(batch) < cfg.grpo.groups_per_step:
            lease = scheduler.issue("sync", cfg.grpo.groups_per_step)
            groups = _sampled_groups(policy, prompts, list(lease.tickets.values()), settings, task)
            for group in groups:
                scheduler.finish(lease.lease_id, group.group_id)
            batch += [g for g in groups if g.is_informative]
        trainer.step(build_train_batch(batch[: cfg.grpo.groups_per_step], scale_by_std=cfg.grpo.scale_by_std))
        if step % EVAL_EVERY == 0:
            weights = {k: mx.array(v) for k, v in trainable_weights(policy.model).items()}
            snapshots.append((step, time.time() - launched, weights))
    curve = []
    for step, seconds, weights in snapshots:
        policy.model.load_weights(list(weights.items()), strict=False)
        curve.append((step, seconds, evaluate(policy.model, policy.tokenizer, task, cfg)))
    return curve


def time_to(curve: list[tuple[int, float, float]], target: float) -> Optional[float]:
    return next((seconds for _, seconds, reward in curve if reward >= target), None)


def run(report: Report, quick: bool) -> None:
    steps = 500 if quick else 1500
    with tempfile.TemporaryDirectory(prefix="grpo-bench-e2e-") as tmp:
        cfg = _config(Path(tmp), steps)
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
        before = held_out_reward(model_path, cfg)
        # The demo's success bar: +0.3 absolute and at least double (quick: +0.1).
        target = max(before + (0.1 if quick else 0.3), 2 * before)
        fleet = fleet_curve(cfg)
        sync = sync_curve(cfg, model_path)
        print(f"held-out before {before:.3f}, target {target:.3f}")
        print("fleet (step, s, reward):", [(s, round(t, 1), round(r, 3)) for s, t, r in fleet])
        print("sync  (step, s, reward):", [(s, round(t, 1), round(r, 3)) for s, t, r in sync])
        fleet_s, sync_s = time_to(fleet, target), time_to(sync, target)
        notes = f"target held-out reward {target:.3f} (before {before:.3f}); snapshots every {EVAL_EVERY} steps"
        if fleet_s is None or sync_s is None:
            notes += f"; not reached in {steps} steps by: " + ", ".join(n for n, s in (("fleet", fleet_s), ("sync", sync_s)) if s is None)
        report.add(Figure("e2e", "wall time to target, learner + 2 actors", fleet_s or float("nan"), "s",
                          baseline=sync_s, baseline_name="synchronous single-process loop s", goal="<= 0.6x", notes=notes))
        report.add(Figure("e2e", "final held-out reward, fleet", fleet[-1][2] if fleet else float("nan"), "",
                          baseline=sync[-1][2] if sync else None, baseline_name="sync loop", notes=f"after {steps} steps"))
