"""Older groups recomputed at their versions inside the step (learner/step/recheck.py): each rank its own rows,
summed, judged as one process judges them; a lie on any rank's rows drops the step, an honest batch trains."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from test_trainer import failed_checks, snapshot, trainer_for

from data_parallel_driver import older_batch, scatter_rows
from grpo_fleet.learner.ranks.sharding import shard_rows
from grpo_fleet.learner.step.batch import take_rows
from grpo_fleet.learner.step.recheck import judge, recompute
from grpo_fleet.learner.step.step_result import LOGPROB_MISMATCH
from grpo_fleet.runtime.trees import flat_leaves


def test_two_ranks_recomputing_their_own_rows_judge_as_one_process(tiny_model_dir: Path):
    trainer = trainer_for(tiny_model_dir, "lora")
    batch = older_batch(trainer, lie=True)
    assert batch.recheck is not None
    recheck = batch.recheck
    model, live = trainer.policy.model, dict(flat_leaves(trainer.policy.model.trainable_parameters()))
    settings = {"temperature": trainer.temperature, "micro_batch_tokens": 40, "chunk_tokens": 16}
    alone = judge(recompute(model, batch, **settings), batch, recheck)
    grid, recomputed = np.zeros(batch.mask.shape, np.float32), []
    for rank in range(2):
        rows = shard_rows(12, rank, 2)
        own = take_rows(batch, rows)
        grid += scatter_rows(recompute(model, own, **settings), rows, 12)
        assert own.recheck is not None
        recomputed.append(int((own.recheck.rows >= 0).sum()))
    spread = judge(grid, batch, recheck)
    assert recomputed == [3, 3], "each rank recomputes its own rows of the older groups"
    assert [(c.index, c.broke) for c in spread] == [(c.index, c.broke) for c in alone] == [(0, None), (1, "token")]
    assert spread[0].worst < 1e-4 and abs(spread[1].worst - 3.0) < 1e-3
    for name, value in flat_leaves(model.trainable_parameters()):
        assert mx.array_equal(value, live[name]), "the live weights are back after each version's forward"


def test_a_lie_in_an_older_group_drops_the_step_and_the_honest_batch_trains(tiny_model_dir: Path):
    trainer = trainer_for(tiny_model_dir, "lora")
    lying = older_batch(trainer, lie=True)
    before = snapshot(trainer)

    stats = trainer.step(lying)

    assert stats.skipped == LOGPROB_MISMATCH and [c.broke for c in failed_checks(stats)] == ["token"]
    assert stats.recomputed_rows == 6 and stats.check_seconds > 0
    after = snapshot(trainer)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    stats = trainer.step(older_batch(trainer, lie=False))
    assert stats.skipped is None and [c.broke for c in stats.rechecked] == [None, None]
