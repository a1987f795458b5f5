"""Pure helpers of the real-model benchmarks: the stand-in task, staleness bookkeeping, gap summaries."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from grpo_fleet.bench.logprob_gap_real import GapDistribution
from grpo_fleet.bench.offpolicy import OffPolicyStats, lagged_training
from grpo_fleet.bench.offpolicy_real import RealRun, by_staleness, staleness_of
from grpo_fleet.bench.real_task import addition_rows, first_integer, first_integer_is_answer, real_config, real_model_dir
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.learner.verify.actor_checks import LogprobGap
from grpo_fleet.tasks import build_task


def test_first_integer_reads_the_first_number_written_sign_included():
    assert first_integer("12 + 7 = 9") == 12
    assert first_integer("The answer is -3, not 4") == -3
    assert first_integer("no digits here") is None


def test_the_stand_in_reward_pays_only_when_the_first_integer_is_the_sum():
    assert first_integer_is_answer("19", answer="19") == 1.0
    assert first_integer_is_answer("The sum is 19.", answer="19") == 1.0
    assert first_integer_is_answer("12 + 7 = 19", answer="19") == 0.0  # restating the question first is not answering
    assert first_integer_is_answer("I cannot say", answer="19") == 0.0


def test_addition_rows_are_distinct_correct_and_seeded():
    rows = addition_rows(50, seed=3, high=9)
    assert rows == addition_rows(50, seed=3, high=9) and rows != addition_rows(50, seed=4, high=9)
    assert len({row["prompt"] for row in rows}) == 50
    for row in rows:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert int(row["answer"]) == a + b and max(a, b) <= 9
    with pytest.raises(ValueError, match="distinct sums"):
        addition_rows(101, seed=0, high=9)


def test_the_stand_in_config_trains_the_given_model_with_lora_on_the_addition_task(tmp_path):
    cfg = real_config(tmp_path / "run", model_dir="/models/m", seed=2, steps=7)
    assert (cfg.model.path, cfg.train.seed, cfg.train.steps) == ("/models/m", 2, 7)
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.lora.scale == 20.0 and cfg.optim.lr == 2e-5
    assert cfg.task.chat_template
    task = build_task(cfg.task)
    assert len(task.eval) == 32 and not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    example = task.eval[0]
    assert task.score(f"{example.answer}", example) == 1.0 and task.score("nothing", example) == 0.0


def test_a_task_config_file_replaces_the_stand_in_but_not_model_seed_or_steps(tmp_path):
    path = tmp_path / "real.toml"
    path.write_text('[model]\npath = "elsewhere"\n[task]\nname = "reverse"\n[grpo]\ngroups_per_step = 3\n')
    cfg = real_config(tmp_path / "run", model_dir="/models/m", seed=1, steps=5, config_path=str(path),
                      overrides=["optim.lr=0.001"])
    assert cfg.task.name == "reverse" and cfg.grpo.groups_per_step == 3 and cfg.optim.lr == 0.001
    assert (cfg.model.path, cfg.train.seed, cfg.train.steps) == ("/models/m", 1, 5)


def test_the_real_model_dir_can_be_pointed_elsewhere(monkeypatch):
    monkeypatch.setenv("GRPO_FLEET_REAL_MODEL", "/somewhere/else")
    assert real_model_dir() == "/somewhere/else"


def _stats(gap_mean: float, gap_max: float, clip: float = 0.0, capped: float = 0.0) -> StepStats:
    return StepStats(loss=0.0, kl=0.0, clip_fraction=clip, grad_norm=0.0, policy_objective=0.0, ratio_mean=1.0,
                     ref_seconds=0.0, update_seconds=0.0, train_seconds=0.0, peak_memory_bytes=0, micro_batches=1,
                     epochs=1, offpolicy_gap_mean=gap_mean, offpolicy_gap_max=gap_max, is_capped_fraction=capped)


def test_a_lagged_run_reaches_its_lag_only_once_there_are_that_many_older_versions():
    assert [staleness_of(step, 2) for step in range(1, 6)] == [0, 1, 2, 2, 2]
    assert [staleness_of(step, 0) for step in range(1, 4)] == [0, 0, 0]


def test_offpolicy_stats_average_over_steps_but_keep_the_largest_gap():
    stats = OffPolicyStats.of([_stats(0.1, 1.0, clip=0.2, capped=0.0), _stats(0.3, 0.5, clip=0.0, capped=0.1)])
    assert stats == OffPolicyStats(pytest.approx(0.2), 1.0, pytest.approx(0.1), pytest.approx(0.05))


def test_steps_pool_by_the_staleness_they_trained_at_per_objective():
    runs = [
        RealRun("coupled", 1, 0, 0.5, [(0, _stats(0.0, 0.0)), (1, _stats(0.1, 1.0))]),
        RealRun("coupled", 4, 0, 0.5, [(0, _stats(0.0, 0.0)), (1, _stats(0.3, 2.0))]),
        RealRun("decoupled", 1, 0, 0.5, [(0, _stats(9.0, 9.0)), (1, _stats(9.0, 9.0))]),
    ]
    pooled = by_staleness(runs, "coupled")
    assert list(pooled) == [0, 1]
    assert pooled[1].gap_mean == pytest.approx(0.2) and pooled[1].gap_max == 2.0
    assert by_staleness(runs, "decoupled")[0].gap_mean == 9.0


def test_gap_distribution_counts_groups_beyond_the_bound_as_false_rejections():
    gaps = [LogprobGap(f"g{i}", mean, mean * 10, 0.05) for i, mean in enumerate([0.001, 0.002, 0.003, 0.06])]
    dist = GapDistribution.of(gaps, bound=0.05)
    assert dist.groups == 4 and dist.rejected == 1
    assert dist.max == 0.06 and dist.token_max == pytest.approx(0.6) and dist.p50 == pytest.approx(0.0025)
    assert dist.mean == pytest.approx(0.0165) and 0.003 < dist.p99 <= 0.06
    assert GapDistribution.of(gaps[:3], bound=0.05).rejected == 0


def test_the_stand_in_rows_are_json_lines(tmp_path):
    cfg = real_config(tmp_path / "run", model_dir="/models/m", seed=0, steps=1)
    lines = (tmp_path / "run" / "addition-train.jsonl").read_text().splitlines()
    assert cfg.task.train_path and len(lines) == 256 and set(json.loads(lines[0])) == {"prompt", "answer"}


class _CountingLoop:
    """A stand-in TrainLoop: one trainable scalar, each update adds 1, each batch records the value it sampled under."""

    def __init__(self, steps: int) -> None:
        self.policy = SimpleNamespace(model=nn.Linear(1, 1, bias=False))
        self.policy.model.weight = mx.zeros((1, 1))
        self.cfg = SimpleNamespace(train=SimpleNamespace(steps=steps))
        self.sampled: list[float] = []

    def batch(self, sampler, rollout) -> list:
        assert sampler is self.policy
        self.sampled.append(self.policy.model.weight.item())
        return []

    def train(self, batch: list) -> StepStats:
        self.policy.model.weight = self.policy.model.weight + 1
        return _stats(0.0, 0.0)

    def held_out(self) -> float:
        return self.policy.model.weight.item()


def test_each_batch_is_sampled_under_the_weights_of_lag_updates_back_and_training_goes_on_from_the_live_ones():
    loop = _CountingLoop(steps=6)
    points, steps = lagged_training(loop, lag=2, eval_every=3)  # type: ignore[arg-type]
    assert loop.sampled == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert [(step, reward) for step, _, reward in points] == [(3, 3.0), (6, 6.0)] and len(steps) == 6
    on_policy = _CountingLoop(steps=3)
    lagged_training(on_policy, lag=0, eval_every=3)  # type: ignore[arg-type]
    assert on_policy.sampled == [0.0, 1.0, 2.0]
