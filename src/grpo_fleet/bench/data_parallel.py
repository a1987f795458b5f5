"""Benchmark: the data-parallel learner's step at 1 and 2 ranks, and what its all-reduce costs.

The ~50M bench model, LoRA r8 and full fine-tuning, 4 groups of 8 (32-token
prompts, 64-token completions). One rank is a plain `Trainer.step` in this
process; two ranks are this module's `__main__` on a ring on 127.0.0.1, started
as `mlx.launch -n 2 --backend ring` starts them (MLX_HOSTFILE, MLX_RANK) but
without its launcher, which spins a core while they run and would take one of
this machine's two from the ranks. Rank 0 broadcasts each batch as the learner does.
The figures: rank 0's step time, the seconds its gradient all-sum took (its
share of the step) and the bytes it all-reduced per step. On one machine two
ranks share its cores, so they cannot be faster; the all-reduce share is the
figure that carries over to several Macs (over loopback here, not a network).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.models import model_50m
from grpo_fleet.bench.step import synthetic_groups
from grpo_fleet.config import DistributedConfig, GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.ranks.collectives import launched_rank
from grpo_fleet.learner.step.batch import TrainBatch, build_train_batch
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import load_policy

SHAPE = (4, 8, 32, 64)  # groups, group size, prompt tokens, completion tokens
GRADIENTS = "gradient all-sum"


def _trainer(path: str, mode: str) -> Trainer:
    mx.random.seed(0)
    policy = load_policy(path, lora=LoraConfig(enabled=True, rank=8) if mode == "lora" else None)
    ref = None if mode == "lora" else load_policy(path).model
    return Trainer(policy, GRPOConfig(beta=0.04), OptimConfig(lr=1e-5), temperature=1.0, max_tokens=SHAPE[3],
                   ref_model=ref)


def _batch(trainer: Trainer) -> TrainBatch:
    return build_train_batch(synthetic_groups(*SHAPE, vocab=trainer.policy.vocab_size))


def one_rank(path: str, mode: str, repeats: int) -> float:
    """Seconds per `Trainer.step` in this process, after a warm-up."""
    trainer = _trainer(path, mode)
    batch = _batch(trainer)
    trainer.step(batch)
    started = time.perf_counter()
    for _ in range(repeats):
        trainer.step(batch)
    return (time.perf_counter() - started) / repeats


def ranked(path: str, mode: str, repeats: int, out: Path) -> None:
    """One rank of the 2-rank run (`two_ranks`); rank 0 writes its step and all-sum figures to `out`."""
    from grpo_fleet.learner.ranks.distributed import DataParallel, connect, share_doorbell
    from grpo_fleet.learner.ranks.follower import join_doorbell
    from grpo_fleet.learner.ranks.sharding import Command, Header

    rank = launched_rank()
    assert rank is not None, "run with MLX_RANK and MLX_HOSTFILE set (two_ranks)"
    cfg = DistributedConfig(timeout_seconds=600, idle_timeout_seconds=600)
    ranks = connect(cfg, rank, authenticated=False)
    assert ranks is not None, "needs 2 ranks"
    if rank == 0:  # the ranks wait for rank 0's commands as the learner's do
        share_doorbell(ranks, cfg)
    else:
        join_doorbell(ranks)
    trainer = _trainer(path, mode)
    sharding = DataParallel(ranks, digest_every=10**9)
    trainer.sharding = sharding
    if rank > 0:
        while (header := sharding.receive()).command != Command.STOP:
            trainer.step(sharding.receive_batch(header))
        return
    batch = _batch(trainer)
    trainer.step(batch)  # warm-up
    before = _gradient_totals(ranks.totals)
    started = time.perf_counter()
    for _ in range(repeats):
        trainer.step(batch)
    step = (time.perf_counter() - started) / repeats
    seconds, sent = (now - then for now, then in zip(_gradient_totals(ranks.totals), before))
    sharding.send(Header(Command.STOP))
    out.write_text(json.dumps({"step": step, "allreduce": seconds / repeats, "bytes": sent / repeats}))


def _gradient_totals(totals: dict[str, list[float]]) -> list[float]:
    """[seconds, bytes] of the gradient sum so far: its gather and the gather of the ranks' tags over their parts."""
    parts = [totals.get(name, [0.0, 0.0]) for name in (GRADIENTS, f"{GRADIENTS} (tags)")]
    return [sum(values) for values in zip(*parts)]


def two_ranks(path: str, mode: str, repeats: int, root: Path) -> dict[str, float]:
    from grpo_fleet.protocol.endpoints import free_port
    from grpo_fleet.runtime.blas import child_env

    out, hostfile = root / f"ranks-{mode}.json", root / f"hosts-{mode}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    command = [sys.executable, "-m", "grpo_fleet.bench.data_parallel", path, mode, str(repeats), str(out)]
    # One BLAS thread per rank: two ranks of two spinning OpenBLAS threads each thrash two cores.
    env = child_env({**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLX_HOSTFILE": str(hostfile)})
    ranks = [subprocess.Popen(command, env={**env, "MLX_RANK": str(rank)}) for rank in range(2)]
    try:
        codes = [rank.wait(timeout=1800) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"data-parallel bench ranks exited {codes}")
    return dict(json.loads(out.read_text()))


def run(report: Report, scale: Scale) -> None:
    repeats = 2 if scale is Scale.QUICK else 5
    with tempfile.TemporaryDirectory(prefix="grpo-bench-dp-") as tmp:
        root = Path(tmp)
        path = str(model_50m(root))
        modes = (("lora", "50M model, LoRA r8"), ("full", "50M model, full FT"))
        for mode, label in modes[:1] if scale is Scale.QUICK else modes:  # quick: LoRA only
            single = one_rank(path, mode, repeats)
            pair = two_ranks(path, mode, repeats, root)
            report.add(Figure("data_parallel", f"{label}: step at 2 ranks (rank 0)", pair["step"] * 1e3, "ms",
                              baseline=single * 1e3, baseline_name="1 rank ms",
                              notes="2 ranks share this machine's cores"))
            report.add(Figure("data_parallel", f"{label}: gradient all-reduce per step, 2 ranks",
                              pair["allreduce"] * 1e3, "ms", baseline=pair["step"] * 1e3,
                              baseline_name="2-rank step ms", goal="share <= 10% (LoRA, real-shape model)",
                              notes="loopback ring; includes waiting for the other rank's micro-batches"))
            report.add(Figure("data_parallel", f"{label}: bytes all-reduced per step", pair["bytes"] / 1e6, "MB"))


if __name__ == "__main__":
    ranked(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
