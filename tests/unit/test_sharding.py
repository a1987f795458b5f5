"""The data-parallel learner's pure parts: row sharding, the step header, the weights digest, the watchdog,
and the rule that makes N ranks exact: per-rank sums under the whole batch's totals add up to one process's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from data_parallel_driver import fixed_batch, scatter_rows
from grpo_fleet.config import ConfigError, GRPOConfig, LoraConfig, OptimConfig, RunConfig
from grpo_fleet.learner.ranks.collectives import Watchdog, launched_backend
from grpo_fleet.learner.ranks.distributed import check_batch_fits
from grpo_fleet.learner.ranks.sharding import (
    MAX_CHECK_VERSIONS,
    Command,
    Header,
    buckets,
    shard_rows,
    weights_digest,
)
from grpo_fleet.learner.step.batch import batch_totals, split_batch, take_rows
from grpo_fleet.learner.step.fused_check import Recheck
from grpo_fleet.learner.step.objective import proximal_grid
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import load_policy


@pytest.mark.parametrize("total,size", [(8, 2), (7, 2), (9, 4), (3, 3), (5, 1)])
def test_shard_rows_gives_every_row_to_exactly_one_rank_in_fair_shares(total, size):
    shards = [shard_rows(total, rank, size) for rank in range(size)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(total))
    counts = [len(s) for s in shards]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1


def test_shard_rows_refuses_a_batch_with_fewer_rows_than_ranks():
    with pytest.raises(ValueError, match="cannot be split over 4 learner ranks"):
        shard_rows(3, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        shard_rows(8, 2, 2)


def test_a_config_whose_batch_cannot_cover_the_ranks_is_a_config_error():
    cfg = RunConfig.model_validate({"grpo": {"groups_per_step": 1}, "generation": {"group_size": 2}})
    check_batch_fits(cfg, 2)
    with pytest.raises(ConfigError, match="groups_per_step"):
        check_batch_fits(cfg, 3)


def test_header_round_trips_and_refuses_a_wrong_shape():
    header = Header(Command.STEP, rows=16, width=48, num_groups=4, versions=2)
    assert Header.decode(header.encode()) == header
    assert Header.decode(Header(Command.STOP).encode()).command == Command.STOP
    with pytest.raises(ValueError, match="int32 words"):
        Header.decode(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="versions' weights"):
        Header.decode(Header(Command.STEP, 4, 3, 2, versions=MAX_CHECK_VERSIONS + 1).encode())


def test_each_rank_recomputes_exactly_the_picked_rows_it_trains():
    """Which rank checks which completion of an older group: the one whose rows hold it, each row once."""
    batch = fixed_batch(64, seed=0)  # 3 groups of 4: rows 0-11, group-major
    slots = np.full(12, -1, np.int32)
    slots[[1, 2, 8, 9, 10, 11]] = [0, 0, 1, 1, 1, 1]  # two completions of group 0 at one version, group 2 whole at another
    batch.recheck = Recheck(np.full((3, 2), np.inf, np.float32), slots, ((), ()))  # two versions (weights unused)
    mine = {rank: take_rows(batch, shard_rows(12, rank, 2)).recheck for rank in range(2)}
    picked = {rank: shard_rows(12, rank, 2)[r.rows >= 0].tolist() for rank, r in mine.items() if r is not None}
    assert picked == {0: [2, 8, 10], 1: [1, 9, 11]}, "the work is spread: each rank its own rows of the groups"
    assert mine[0] is not None and mine[0].rows.tolist() == [-1, 0, -1, -1, 1, 1]


def test_scattered_shards_sum_back_to_the_whole_grid():
    grid = np.arange(7 * 5, dtype=np.float32).reshape(7, 5) + 1
    total = sum(scatter_rows(grid[rows], rows, 7) for rows in (shard_rows(7, r, 3) for r in range(3)))
    np.testing.assert_array_equal(total, grid)


def test_weights_digest_sees_a_one_ulp_change_and_handles_bfloat16():
    tree = {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3), "b": {"c": mx.ones(4, dtype=mx.bfloat16)}}
    same = {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3), "b": {"c": mx.ones(4, dtype=mx.bfloat16)}}
    np.testing.assert_array_equal(weights_digest(tree), weights_digest(same))
    nudged = np.array(tree["a"])
    nudged[1, 2] = np.nextafter(nudged[1, 2], np.float32(10))
    changed = {"a": mx.array(nudged), "b": same["b"]}
    assert not np.array_equal(weights_digest(tree), weights_digest(changed))
    assert weights_digest(tree).dtype == np.int32 and weights_digest(tree).shape == (4,)


def test_watchdog_fires_only_past_its_bound():
    fired: list[str] = []
    done = threading.Event()
    dog = Watchdog(rank=1, on_expiry=lambda message: (fired.append(message), done.set()))
    with dog.bound("quick all-sum", 5.0):
        pass
    with dog.bound("gradient all-sum", 0.05):
        assert done.wait(5.0)
    time.sleep(0.1)
    assert len(fired) == 1
    assert "rank 1: gradient all-sum did not finish within 0.05 s" in fired[0]


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_rank_sums_under_the_batch_totals_equal_one_process(tiny_model_dir: Path, mode: str, loss_type: str):
    mx.random.seed(0)
    policy = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4) if mode == "lora" else None)
    trainer = Trainer(policy, GRPOConfig(beta=0.0, loss_type=loss_type, groups_per_step=3), OptimConfig(),
                      temperature=1.0, max_tokens=8, micro_batch_tokens=40)
    batch = fixed_batch(policy.vocab_size, seed=3)
    totals = batch_totals(batch)
    micro = split_batch(batch, trainer.micro_batch_tokens)
    whole = trainer.accumulate(micro, [None] * len(micro), totals)
    rows_total = batch.mask.shape[0]
    parts, grid = [], np.zeros(batch.mask.shape, np.float32)
    for rank in range(3):
        rows = shard_rows(rows_total, rank, 3)
        own = take_rows(batch, rows)
        own_micro = split_batch(own, trainer.micro_batch_tokens)
        part = trainer.accumulate(own_micro, [None] * len(own_micro), totals)
        parts.append(part)
        local = proximal_grid(own, own_micro, part.policy_logprobs)
        assert local is not None
        grid += scatter_rows(local, rows, rows_total)
    assert abs(sum(float(p.loss) for p in parts) - float(whole.loss)) <= 1e-5 * max(1.0, abs(float(whole.loss)))
    for key, value in whole.stats.items():
        assert sum(float(p.stats[key]) for p in parts) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
    want = dict(tree_flatten(whole.grads))
    summed = {k: sum(np.array(dict(tree_flatten(p.grads))[k]) for p in parts) for k in want}
    scale = max(float(np.abs(np.array(v)).max()) for v in want.values())
    assert scale > 0
    worst = max(float(np.abs(summed[k] - np.array(v)).max()) for k, v in want.items())
    assert worst <= 1e-5 * scale
    full_grid = proximal_grid(batch, micro, whole.policy_logprobs)
    assert full_grid is not None
    np.testing.assert_allclose(grid, full_grid, rtol=1e-5, atol=1e-6)


def test_buckets_group_one_dtype_up_to_the_limit_and_keep_every_array_once():
    sizes = [40, 30, 50, 10, 200, 5]
    kinds = ["f32", "f32", "f32", "i32", "f32", "f32"]
    groups = buckets(sizes, kinds, limit=100)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    for group in groups:
        assert len({kinds[i] for i in group}) == 1
        assert len(group) == 1 or sum(sizes[i] for i in group) <= 100
    assert [4] in groups  # over the limit: alone
    assert groups == [[0, 1], [2], [3], [4], [5]]  # a bucket closes when the next array would overflow it


def test_auto_backend_follows_the_launcher():
    assert launched_backend("auto", {"MLX_RANK": "1", "MLX_HOSTFILE": "/tmp/h"}) == "ring"
    assert launched_backend("auto", {"OMPI_COMM_WORLD_RANK": "0"}) == "mpi"
    assert launched_backend("auto", {"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "10.0.0.1:32323"}) == "jaccl"
    assert launched_backend("ring", {"OMPI_COMM_WORLD_RANK": "0"}) == "ring"
