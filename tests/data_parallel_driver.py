"""Train the tiny model k steps on fixed batches, for every loss type, LoRA and full, in one process or as
data-parallel ranks (started as `mlx.launch` starts them, with MLX_HOSTFILE and MLX_RANK):
tests/integration/test_data_parallel.py compares the two.

    python tests/data_parallel_driver.py MODEL_DIR OUT_DIR STEPS

Rank 0 (or the single process) writes OUT_DIR/{mode}-{variant}.safetensors (the trainable weights after the
steps, and `init.*` before them) and OUT_DIR/{mode}-{variant}.json (each step's stats). The other ranks go
through the follower's own setup (`join_run`): rank 0's config, weights and optimizer state, then its batches.
Last, under LoRA, two steps whose older groups are recomputed in the step (an honest batch, then one with a lie
in rank 1's rows): rank 0 writes OUT_DIR/recheck.json, rank 1 prints the completions it recomputed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.ranks.collectives import RankGroup, launched_rank
from grpo_fleet.learner.ranks.distributed import DataParallel, connect, share_doorbell, start_rank0, stop_others
from grpo_fleet.learner.ranks.follower import join_doorbell, join_run
from grpo_fleet.learner.ranks.rank_metrics import FollowerMetrics, follower_metrics
from grpo_fleet.learner.ranks.sharding import Command, weights_digest
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import TrainBatch, build_train_batch
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.objective import policy_logprobs
from grpo_fleet.learner.step.trainer import Trainer, load_trainer
from grpo_fleet.models.loading import model_digest
from grpo_fleet.runtime.trees import flat_leaves

VARIANTS = {  # name: (loss_type, objective, ppo_epochs)
    "grpo": ("grpo", "coupled", 1), "dapo": ("dapo", "coupled", 1), "dr_grpo": ("dr_grpo", "coupled", 1),
    "gspo": ("gspo", "coupled", 1), "decoupled-2epochs": ("grpo", "decoupled", 2),
}
MODES = ("lora", "full")


def scatter_rows(values: np.ndarray, rows: np.ndarray, total: int) -> np.ndarray:
    """A `[total, L]` grid of zeros with `values[i]` in row `rows[i]`: summed over ranks, the whole grid."""
    out = np.zeros((total, *values.shape[1:]), dtype=values.dtype)
    out[rows] = values
    return out


def run_config(model_dir: str, mode: str, variant: str) -> RunConfig:
    loss_type, objective, epochs = VARIANTS[variant]
    return RunConfig.model_validate({
        "model": {"path": model_dir}, "lora": {"enabled": mode == "lora", "rank": 4},
        "generation": {"group_size": 4, "max_tokens": 8},
        "grpo": {"loss_type": loss_type, "objective": objective, "ppo_epochs": epochs, "beta": 0.04,
                 "groups_per_step": 3},
        "optim": {"lr": 1e-4}, "train": {"micro_batch_tokens": 40},
        "distributed": {"timeout_seconds": 60, "idle_timeout_seconds": 60, "digest_every": 1},
    })


def fixed_batch(vocab: int, seed: int) -> TrainBatch:
    """Three groups of four completions of 2-8 tokens: random tokens, behaviour logprobs and rewards."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(3):
        completions = [
            CompletionRecord(tokens=rng.integers(1, vocab, size=n).astype(np.int32),
                             logprobs=-rng.uniform(0.5, 3.0, size=n).astype(np.float32),
                             reward=float(rng.integers(0, 2)) + 0.1 * i, finish_reason="stop")
            for i, n in enumerate(rng.integers(2, 9, size=4))
        ]
        prompt = rng.integers(1, vocab, size=3 + g).astype(np.int32)
        groups.append(AcceptedGroup(f"g{g}", g, prompt, completions, policy_version=0, actor_id="driver"))
    return build_train_batch(groups)


def older_batch(trainer: Trainer, lie: bool) -> TrainBatch:
    """A batch sampled at the weights before `trainer`'s next step (which this takes), to recompute at them: group 0
    two completions, group 1 whole, group 2 not; `lie`: one token of row 5 (rank 1's of 2) moved by 3 nats."""
    model = trainer.policy.model
    batch = fixed_batch(trainer.policy.vocab_size, seed=5)
    older = tuple(flat_leaves(model.trainable_parameters()))
    reported = np.array(policy_logprobs(model, batch.inputs, batch.targets, trainer.temperature)) * np.array(batch.mask)
    if lie:
        reported[5, np.flatnonzero(np.array(batch.mask)[5])[-1]] += 3.0
    batch.old_logprobs = mx.array(reported)
    assert trainer.step(fixed_batch(trainer.policy.vocab_size, seed=0)).skipped is None  # the version moves on
    rows = np.full(12, -1, np.int32)
    rows[[0, 3, 4, 5, 6, 7]] = 0
    bound = (1.0, 1e-2)  # a loose mean, so the one moved token must decide
    batch.recheck = Recheck(np.array([bound, bound, (np.inf, np.inf)], np.float32), rows, (older,))
    return batch


def lead_checks(ranks: RankGroup | None, cfg: RunConfig, out: Path) -> None:
    """Rank 0 or the single process: an honest batch of older groups, then a lying one; their verdicts."""
    mx.random.seed(0)
    trainer = load_trainer(cfg, cfg.model.path)
    if ranks is not None:
        start_rank0(ranks, cfg, trainer, model_digest(cfg.model.path), step=0)
    verdicts = []
    for lie in (False, True):
        batch = older_batch(trainer, lie)
        before = weights_digest(trainer.policy.model.trainable_parameters())
        stats = trainer.step(batch)
        unchanged = bool(np.array_equal(before, weights_digest(trainer.policy.model.trainable_parameters())))
        verdicts.append({"skipped": stats.skipped, "rechecked": [[c.index, c.broke] for c in stats.rechecked],
                         "recomputed_rows": stats.recomputed_rows, "unchanged": unchanged,
                         "check_seconds": stats.check_seconds})
    if ranks is not None:
        stop_others(ranks)
    (out / "recheck.json").write_text(json.dumps(verdicts))


def lead(ranks: RankGroup | None, cfg: RunConfig, steps: int, out: Path, name: str) -> None:
    """Rank 0 or the single process: train `steps` fixed batches and write the weights and stats."""
    mx.random.seed(0)  # the same LoRA initialisation in every run
    trainer = load_trainer(cfg, cfg.model.path)
    initial = {f"init.{k}": mx.array(v) for k, v in flat_leaves(trainer.policy.model.trainable_parameters())}
    if ranks is not None:
        start_rank0(ranks, cfg, trainer, model_digest(cfg.model.path), step=0)
    stats = [asdict(trainer.step(fixed_batch(trainer.policy.vocab_size, seed))) for seed in range(steps)]
    if ranks is not None:
        stop_others(ranks)
    weights = dict(flat_leaves(trainer.policy.model.trainable_parameters()))
    mx.save_safetensors(str(out / f"{name}.safetensors"), {**weights, **initial})
    keep = ("loss", "kl", "clip_fraction", "grad_norm", "policy_objective", "ratio_mean", "offpolicy_gap_mean",
            "offpolicy_gap_max", "is_capped_fraction", "epochs", "skipped")
    (out / f"{name}.json").write_text(json.dumps([{k: s[k] for k in keep} for s in stats]))


def follow(ranks: RankGroup, metrics: FollowerMetrics | None = None) -> int:
    """A rank > 0: rank 0's setup, then its batches until it says stop; returns the steps trained."""
    cfg, trainer = join_run(ranks)
    sharding = DataParallel(ranks, cfg.distributed.digest_every)
    trainer.sharding = sharding
    while (header := sharding.receive()).command != Command.STOP:
        if header.command == Command.STEP:
            started = time.perf_counter()
            stats = trainer.step(sharding.receive_batch(header, flat_leaves(trainer.policy.model.trainable_parameters())))
            if metrics is not None:
                metrics.observe_step(started, stats.recomputed_rows)
    return sharding.steps


def main(model_dir: str, out_dir: str, steps: int) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = launched_rank()
    distributed = run_config(model_dir, "lora", "grpo").distributed
    ranks = None if rank is None else connect(distributed, rank, authenticated=False)
    if ranks is not None:  # as the learner does once the ring is proven
        if ranks.rank == 0:
            share_doorbell(ranks, distributed)
        else:
            join_doorbell(ranks)
    for mode in MODES:
        for variant in VARIANTS:
            if ranks is not None and ranks.rank > 0:
                trained = follow(ranks)
                print(f"rank {ranks.rank}: {mode}-{variant}: {trained} steps", flush=True)
            else:
                started = time.perf_counter()
                lead(ranks, run_config(model_dir, mode, variant), steps, out, f"{mode}-{variant}")
                print(f"rank 0: {mode}-{variant}: {time.perf_counter() - started:.1f} s", flush=True)
    if ranks is not None and ranks.rank > 0:
        metrics = follower_metrics(ranks)
        follow(ranks, metrics)
        name, labels = "grpo_fleet_learner_rank_check_completions_total", {"rank": str(ranks.rank)}
        print(f"rank {ranks.rank}: recomputed {metrics.registry.get_sample_value(name, labels):g} completions", flush=True)
    else:
        started = time.perf_counter()
        lead_checks(ranks, run_config(model_dir, "lora", "grpo"), out)
        print(f"rank 0: lora-recheck: {time.perf_counter() - started:.1f} s", flush=True)
    print(f"rank {0 if ranks is None else ranks.rank}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
