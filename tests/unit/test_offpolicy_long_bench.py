"""The pure parts of bench offpolicy_long: its arms, the lag it reads from the simulator, its config and KL."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.bench import Scale
from grpo_fleet.bench.offpolicy import lagged_training
from grpo_fleet.bench.offpolicy_long import SIZES, arms, lag_from, long_config, reference_kl, simulated_staleness, with_arm
from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import build_train_batch
from grpo_fleet.learner.step.step_result import StepStats
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import load_policy


def test_the_first_arm_is_the_shipped_default_then_beta_0_then_every_other_objective():
    defaults = GRPOConfig()
    chosen = arms(defaults)
    assert chosen[0].grpo == {"objective": defaults.objective, "beta": defaults.beta}
    objectives = set(typing.get_args(GRPOConfig.model_fields["objective"].annotation))
    assert {a.grpo["objective"] for a in chosen} == objectives and len(objectives) > 1
    assert chosen[1].grpo == {"objective": defaults.objective, "beta": 0.0}
    assert {"objective": "decoupled", "beta": defaults.beta, "is_level": "sequence"} in [a.grpo for a in chosen]
    assert len({a.name for a in chosen}) == len(chosen)
    assert len(arms(defaults, full=True)) == len(chosen) + 1


def test_with_a_default_of_beta_0_there_is_no_second_beta_0_arm():
    chosen = arms(GRPOConfig(beta=0.0))
    assert [a.grpo["beta"] for a in chosen] == [0.0] * len(chosen)
    assert not any(a.name.startswith("beta 0") for a in chosen)


def test_the_lag_is_the_simulators_mean_staleness_rounded_and_never_on_policy():
    assert lag_from(1.975) == 2 and lag_from(2.6) == 3 and lag_from(0.37) == 1


def test_the_simulator_puts_8_macs_at_512_tokens_about_2_versions_behind():
    mean, p90 = simulated_staleness()  # docs/simulator.md's table: 1.98, p90 2
    assert 1.5 < mean <= 2.0 and p90 == 2 and lag_from(mean) == 2


def test_the_config_is_the_long_answer_recipe_at_the_benchs_sizes(tmp_path):
    sizes = SIZES[Scale.DEFAULT]
    cfg = long_config(tmp_path, "/models/m", sizes, seed=3)
    assert cfg.generation.max_tokens == 256 and cfg.generation.temperature == 0.7
    assert cfg.task.rewards == ["countries_listed"] and cfg.train.eval_mode == "sampled"
    assert (cfg.grpo.groups_per_step, cfg.generation.group_size) == (sizes.groups, sizes.group_size)
    assert (cfg.task.num_eval, cfg.train.eval_samples, cfg.train.steps) == (sizes.eval_prompts, sizes.eval_samples,
                                                                            sizes.steps)
    assert cfg.model.path == "/models/m" and cfg.train.seed == 3 and cfg.lora.enabled
    beta0 = with_arm(cfg, arms(GRPOConfig())[1])
    assert beta0.grpo.beta == 0.0 and beta0.grpo.groups_per_step == sizes.groups


class _Loop:
    """A stand-in TrainLoop whose batches say which step sampled them."""

    def __init__(self, steps: int) -> None:
        self.policy = SimpleNamespace(model=nn.Linear(1, 1, bias=False))
        self.cfg = SimpleNamespace(train=SimpleNamespace(steps=steps))
        self.trained: list[list] = []

    def batch(self, sampler, rollout) -> list:
        return [len(self.trained)]

    def train(self, batch: list) -> StepStats:
        self.trained.append(batch)
        return StepStats(loss=0.0, grad_norm=0.0, ref_seconds=0.0, update_seconds=0.0, train_seconds=0.0,
                         micro_batches=1, epochs=1, peak_memory_bytes=0)

    def held_out(self) -> float:
        return 0.0


def test_each_batch_is_seen_before_it_trains():
    loop, seen = _Loop(steps=3), []
    lagged_training(loop, lag=2, eval_every=3, on_batch=lambda batch: seen.append((batch, len(loop.trained))))  # type: ignore[arg-type]
    assert seen == [([0], 0), ([1], 1), ([2], 2)]


def _groups(vocab: int) -> list[AcceptedGroup]:
    rng = np.random.default_rng(0)
    groups = []
    for index in range(2):
        records = [CompletionRecord(rng.integers(3, vocab, size=6 + i).astype(np.int32),
                                    np.full(6 + i, -1.0, np.float32), float(i), "stop") for i in range(4)]
        groups.append(AcceptedGroup(f"g{index}", index, rng.integers(3, vocab, size=5).astype(np.int32), records, 0, "a"))
    return groups


def test_the_kl_to_the_reference_is_the_trainers_own_statistic_and_zero_for_the_base(tiny_model_dir):
    mx.random.seed(0)
    policy = load_policy(str(tiny_model_dir), lora=LoraConfig(enabled=True, rank=4, scale=10.0))
    groups = _groups(policy.model.args.vocab_size)
    settings = {"temperature": 0.7, "micro_batch_tokens": 4096, "chunk_tokens": 256}
    assert reference_kl(policy, groups, **settings) < 1e-6  # lora_b starts at zero: the policy is the base
    policy.model.update(tree_unflatten([(k, mx.random.normal(v.shape, scale=0.05))
                                        for k, v in tree_flatten(policy.model.trainable_parameters())]))
    measured = reference_kl(policy, groups, **settings)
    trainer = Trainer(policy, GRPOConfig(beta=0.04), OptimConfig(lr=1e-3), temperature=0.7, max_tokens=16)
    stats = trainer.step(build_train_batch(groups))  # its kl is of the weights before its update
    assert measured > 1e-4 and stats.kl is not None and abs(measured - stats.kl) < 1e-4 * max(1.0, measured)
