"""Tests for grpo_fleet.learner.step.trainer.Trainer on the tiny model, with LoRA and full fine-tuning."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.config import GRPOConfig, LoraConfig, OptimConfig
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.step.batch import TrainBatch, build_train_batch, split_batch, unpack_completions
from grpo_fleet.learner.step.fused_check import check_bounds_array
from grpo_fleet.learner.step.gap_bounds import GapBound
from grpo_fleet.learner.step.grpo import BehaviourCorrection, grpo_loss
from grpo_fleet.learner.step.objective import Loss, LossOutput, behaviour_correction, default_loss, policy_logprobs
from grpo_fleet.learner.step.schedule import learning_rate_schedule
from grpo_fleet.learner.step.step_result import LOGPROB_MISMATCH, CheckedGroup, StepStats
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import Policy, adapters_disabled, load_policy, trainable_weights

TEMPERATURE = 1.0
MAX_TOKENS = 4


def make_policy(model_dir: Path, mode: str) -> Policy:
    lora = LoraConfig(enabled=True, rank=4) if mode == "lora" else None
    return load_policy(str(model_dir), lora=lora)


def make_trainer(
    model_dir: Path, mode: str, *, ppo_epochs: int = 1, lr: float = 1e-3, beta: float = 0.04,
    optim_cfg: OptimConfig | None = None, compile: bool = False,
) -> Trainer:
    policy = make_policy(model_dir, mode)
    ref_model = None
    if mode == "full" and beta > 0:
        ref_model = load_policy(str(model_dir)).model
        ref_model.freeze()
    return Trainer(
        policy,
        GRPOConfig(beta=beta, groups_per_step=1, ppo_epochs=ppo_epochs),
        optim_cfg or OptimConfig(lr=lr),
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        ref_model=ref_model,
        compile=compile,
    )


def on_policy_batch(policy: Policy, completions: list[list[int]], rewards: list[float]) -> TrainBatch:
    """One group of completions of "123=", with old logprobs taken from the current policy (ratio = 1)."""
    prompt = np.asarray(policy.tokenizer.encode("123=", add_special_tokens=False), dtype=np.int32)
    records = [
        CompletionRecord(
            tokens=np.asarray(tokens, dtype=np.int32),
            logprobs=np.full(len(tokens), -1.0, dtype=np.float32),  # replaced below
            reward=reward,
            finish_reason="length",
        )
        for tokens, reward in zip(completions, rewards)
    ]
    group = AcceptedGroup("g1", 0, prompt, records, policy_version=0, actor_id="test")
    batch = build_train_batch([group])
    current = policy_logprobs(policy.model, batch.inputs, batch.targets, TEMPERATURE)
    batch.old_logprobs = mx.stop_gradient(current * batch.mask)
    mx.eval(batch.old_logprobs)
    return batch


def digit_ids(policy: Policy, text: str) -> list[int]:
    return list(policy.tokenizer.encode(text, add_special_tokens=False))


def sequence_logprobs(policy: Policy, batch: TrainBatch) -> np.ndarray:
    """Per-completion summed logprob over the mask, under the current weights."""
    lp = policy_logprobs(policy.model, batch.inputs, batch.targets, TEMPERATURE)
    return np.array(mx.sum(lp * batch.mask, axis=1))


def flat_state(trainer: Trainer) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(trainer.optimizer.state) if isinstance(v, mx.array)}


@pytest.fixture
def contrast_completions(tiny_model_dir: Path):
    """One rewarded and one penalised completion with disjoint tokens."""
    probe = load_policy(str(tiny_model_dir))
    return [digit_ids(probe, "321"), digit_ids(probe, "777")], [1.0, 0.0]


def test_lora_reference_logprobs_are_the_base_model_even_after_training(tiny_model_dir, contrast_completions):
    trainer = make_trainer(tiny_model_dir, "lora")
    base = load_policy(str(tiny_model_dir))  # no adapters at all
    batch = on_policy_batch(trainer.policy, *contrast_completions)
    # pi_ref is computed at completion positions only, 0 elsewhere.
    base_lp = np.array(policy_logprobs(base.model, batch.inputs, batch.targets, TEMPERATURE) * batch.mask)

    np.testing.assert_allclose(np.array(reference_logprobs(trainer, batch)), base_lp, atol=1e-5)

    before = sequence_logprobs(trainer.policy, batch)
    trainer.step(batch)
    after = sequence_logprobs(trainer.policy, batch)
    # The adapters really changed the policy...
    assert np.abs(after - before).max() > 1e-4
    # ...but pi_ref is still exactly the base, and the adapters are back on afterwards.
    np.testing.assert_allclose(np.array(reference_logprobs(trainer, batch)), base_lp, atol=1e-5)
    np.testing.assert_allclose(sequence_logprobs(trainer.policy, batch), after, atol=1e-6)


def test_lora_trains_only_the_adapters(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, "lora")
    names = list(trainable_weights(trainer.policy.model))
    assert names and all(name.endswith(("lora_a", "lora_b")) for name in names)
    assert trainer.policy.lora is not None and trainer.policy.lora.rank == 4


def test_full_finetune_reference_is_the_frozen_copy(tiny_model_dir, contrast_completions):
    trainer = make_trainer(tiny_model_dir, "full")
    batch = on_policy_batch(trainer.policy, *contrast_completions)
    start = np.array(reference_logprobs(trainer, batch))
    trainer.step(batch)
    np.testing.assert_allclose(np.array(reference_logprobs(trainer, batch)), start, atol=1e-6)
    moved = np.array(policy_logprobs(trainer.policy.model, batch.inputs, batch.targets, TEMPERATURE))
    assert np.abs(moved * np.array(batch.mask) - start).max() > 1e-4


def test_full_finetune_with_beta_needs_a_reference_model(tiny_model_dir, contrast_completions):
    policy = make_policy(tiny_model_dir, "full")
    trainer = Trainer(policy, GRPOConfig(beta=0.04), OptimConfig(), temperature=1.0, max_tokens=MAX_TOKENS)
    batch = on_policy_batch(policy, *contrast_completions)
    with pytest.raises(ValueError, match="reference model"):
        reference_logprobs(trainer, batch)


def test_beta_zero_skips_the_reference(tiny_model_dir, contrast_completions):
    trainer = make_trainer(tiny_model_dir, "full", beta=0.0)
    batch = on_policy_batch(trainer.policy, *contrast_completions)
    assert reference_logprobs(trainer, batch) is None
    stats = trainer.step(batch)
    assert stats.kl == 0.0


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_step_raises_the_rewarded_completion_and_lowers_the_penalised_one(tiny_model_dir, contrast_completions, mode):
    trainer = make_trainer(tiny_model_dir, mode)
    batch = on_policy_batch(trainer.policy, *contrast_completions)
    advantages = np.array(batch.advantages)
    assert advantages[0] > 0 > advantages[1]

    before = sequence_logprobs(trainer.policy, batch)
    stats = trainer.step(batch)
    after = sequence_logprobs(trainer.policy, batch)

    assert after[0] > before[0]
    assert after[1] < before[1]
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "train_seconds"):
        assert np.isfinite(getattr(stats, key)), key
    # On-policy first step: the ratio is 1, nothing is clipped and pi == pi_ref.
    assert stats.clip_fraction == 0.0
    assert stats.kl == pytest.approx(0.0, abs=1e-6)
    assert stats.grad_norm > 0
    assert stats.skipped is None and stats.micro_batches == 1 and stats.peak_memory_bytes > 0


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_ppo_epochs_take_that_many_optimizer_steps(tiny_model_dir, contrast_completions, mode):
    one = make_trainer(tiny_model_dir, mode, ppo_epochs=1)
    two = make_trainer(tiny_model_dir, mode, ppo_epochs=2)
    start = {k: np.array(v) for k, v in trainable_weights(two.policy.model).items()}

    one.step(on_policy_batch(one.policy, *contrast_completions))
    two.step(on_policy_batch(two.policy, *contrast_completions))

    assert int(one.optimizer.state["step"]) == 1
    assert int(two.optimizer.state["step"]) == 2
    after_one = {k: np.array(v) for k, v in trainable_weights(one.policy.model).items()}
    after_two = {k: np.array(v) for k, v in trainable_weights(two.policy.model).items()}
    # The second epoch moved the weights beyond where a single epoch stops.
    assert any(not np.allclose(after_one[k], after_two[k]) for k in start)
    assert any(not np.allclose(start[k], after_two[k]) for k in start)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_optimizer_state_round_trips_through_safetensors(tiny_model_dir, contrast_completions, mode, tmp_path):
    trainer = make_trainer(tiny_model_dir, mode)
    trainer.step(on_policy_batch(trainer.policy, *contrast_completions))
    path = tmp_path / "optimizer.safetensors"
    trainer.save_optimizer(path)
    saved = flat_state(trainer)
    assert any(k.endswith(".m") for k in saved) and any(k.endswith(".v") for k in saved)

    fresh = make_trainer(tiny_model_dir, mode)
    assert int(fresh.optimizer.state["step"]) == 0
    fresh.load_optimizer(path)
    loaded = flat_state(fresh)

    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype, key
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert int(fresh.optimizer.state["step"]) == 1


def test_loaded_optimizer_resumes_exactly(tiny_model_dir, contrast_completions, tmp_path):
    """Weights + optimizer saved after step 1 and loaded into a new trainer give the same step 2."""
    original = make_trainer(tiny_model_dir, "lora")
    batch = on_policy_batch(original.policy, *contrast_completions)
    original.step(batch)
    weights_after_one = {k: mx.array(np.array(v)) for k, v in trainable_weights(original.policy.model).items()}
    original.save_optimizer(tmp_path / "optimizer.safetensors")

    resumed = make_trainer(tiny_model_dir, "lora")
    resumed.policy.model.load_weights(list(weights_after_one.items()), strict=False)
    resumed.load_optimizer(tmp_path / "optimizer.safetensors")

    original.step(batch)
    resumed.step(batch)
    want = trainable_weights(original.policy.model)
    got = trainable_weights(resumed.policy.model)
    for key in want:
        np.testing.assert_allclose(np.array(got[key]), np.array(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    assert int(resumed.optimizer.state["step"]) == 2


def test_step_stats_report_the_constant_learning_rate(tiny_model_dir, contrast_completions):
    trainer = make_trainer(tiny_model_dir, "lora", lr=3e-4)
    stats = trainer.step(on_policy_batch(trainer.policy, *contrast_completions))
    assert stats.learning_rate == pytest.approx(3e-4)


@pytest.mark.parametrize("compile", [False, True])
def test_resumed_trainer_continues_the_schedule_at_the_same_rate(tiny_model_dir, contrast_completions, tmp_path, compile):
    """Optimizer state saved after 2 updates and loaded into a fresh trainer gives the uninterrupted rates and weights."""
    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, decay_steps=4, min_lr=1e-4)
    expected = [float(learning_rate_schedule(cfg)(mx.array(k, mx.uint64))) for k in range(6)]
    original = make_trainer(tiny_model_dir, "lora", optim_cfg=cfg, compile=compile)
    batch = on_policy_batch(original.policy, *contrast_completions)
    first = [original.step(batch).learning_rate for _ in range(2)]
    weights = {k: mx.array(np.array(v)) for k, v in trainable_weights(original.policy.model).items()}
    original.save_optimizer(tmp_path / "optimizer.safetensors")

    resumed = make_trainer(tiny_model_dir, "lora", optim_cfg=cfg, compile=compile)
    resumed.policy.model.load_weights(list(weights.items()), strict=False)
    resumed.load_optimizer(tmp_path / "optimizer.safetensors")
    uninterrupted = [original.step(batch).learning_rate for _ in range(4)]
    continued = [resumed.step(batch).learning_rate for _ in range(4)]

    assert first + uninterrupted == pytest.approx(expected)
    assert continued == pytest.approx(uninterrupted, rel=0, abs=0)
    assert int(resumed.optimizer.state["step"]) == 6
    want, got = trainable_weights(original.policy.model), trainable_weights(resumed.policy.model)
    for key in want:
        np.testing.assert_allclose(np.array(got[key]), np.array(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
@pytest.mark.parametrize("use_lora", [True, False])
def test_compiled_update_matches_eager_update(tiny_model_dir, use_lora, objective):
    """mx.compile must not change the numbers, including pi_ref under LoRA (adapters swapped, not rescaled)."""
    rng = np.random.default_rng(0)
    groups = [
        AcceptedGroup(f"g{b}", b, rng.integers(0, 10, 4).astype(np.int32), [
            CompletionRecord(rng.integers(0, 10, 5).astype(np.int32), -rng.random(5).astype(np.float32), float(rng.random()),
                             "length")
            for _ in range(4)], 0, "a")
        for b in range(3)
    ]
    batch = build_train_batch(groups)
    finals = []
    for compiled in (False, True):
        lora = LoraConfig(enabled=True, rank=4) if use_lora else None
        mx.random.seed(0)  # same adapter init for both runs
        policy = load_policy(str(tiny_model_dir), lora=lora)
        ref = None if use_lora else load_policy(str(tiny_model_dir)).model
        # ppo_epochs = 2: decoupled, the micro-batches carry pi_prox into the compiled graph.
        trainer = Trainer(policy, GRPOConfig(beta=0.04, ppo_epochs=2, objective=objective), OptimConfig(lr=1e-2),
                          temperature=1.0, max_tokens=5, ref_model=ref, compile=compiled,
                          numpy_exp=False)  # compiling turns NumPy's exp off: the eager arm alike, to compare like
        stats = [trainer.step(batch) for _ in range(3)]
        finals.append((dict(tree_flatten(policy.model.trainable_parameters())), stats[-1]))
    (eager, eager_stats), (fast, fast_stats) = finals
    assert all(mx.allclose(eager[k], fast[k], atol=1e-5) for k in eager)
    assert abs(eager_stats.kl - fast_stats.kl) < 1e-5 and eager_stats.kl > 0


# ------------------------------------------------------- memory-bounded step


def varied_batch(seed: int = 0, groups: int = 3, group_size: int = 4) -> TrainBatch:
    """Off-policy groups with prompt and completion lengths that differ row to row."""
    rng = np.random.default_rng(seed)
    made = []
    for b in range(groups):
        prompt = rng.integers(0, 10, int(rng.integers(2, 7))).astype(np.int32)
        records = []
        for _ in range(group_size):
            length = int(rng.integers(1, 8))
            records.append(CompletionRecord(rng.integers(0, 10, length).astype(np.int32),
                                            -rng.uniform(1.5, 3.5, length).astype(np.float32), float(rng.random()), "length"))
        made.append(AcceptedGroup(f"g{b}", b, prompt, records, 0, "a"))
    return build_train_batch(made)


def reference_logprobs(trainer: Trainer, batch: TrainBatch) -> mx.array | None:
    """pi_ref logprobs on the batch's `[N, L]` grid: completion positions, 0 elsewhere (None when beta = 0)."""
    micro = split_batch(batch, trainer.micro_batch_tokens)
    refs = trainer.references(micro)
    if refs and refs[0] is None:
        return None
    return mx.array(unpack_completions(micro, [ref for ref in refs if ref is not None], batch.mask.shape))


def failed_checks(stats: StepStats) -> list[CheckedGroup]:
    """The step's checks that found a lie, fused and rechecked alike."""
    return [c for c in (*stats.checked, *stats.rechecked) if c.broke is not None]


def trainer_for(model_dir: Path, mode: str, *, loss_type: str = "grpo", compiled: bool = False,
                objective: str = "decoupled", ppo_epochs: int = 1, **memory) -> Trainer:
    lora = LoraConfig(enabled=True, rank=4) if mode == "lora" else None
    mx.random.seed(0)  # the same adapter init in every trainer
    policy = load_policy(str(model_dir), lora=lora)
    if lora is not None:
        # Nonzero lora_b, so the adapters' gradients are not trivially zero.
        policy.model.update(tree_unflatten([(k, mx.random.normal(v.shape, scale=0.05))
                                            for k, v in tree_flatten(policy.model.trainable_parameters())]))
    ref = None if lora else load_policy(str(model_dir)).model
    grpo = GRPOConfig(beta=0.04, loss_type=loss_type, objective=objective, ppo_epochs=ppo_epochs)
    return Trainer(policy, grpo, OptimConfig(lr=1e-2), temperature=0.7, max_tokens=8, ref_model=ref, compile=compiled,
                   **memory)


def dense_gradients(trainer: Trainer, batch: TrainBatch) -> tuple[float, dict[str, np.ndarray]]:
    """The old one-shot computation: full [N, L, V] logits, one batch, grpo_loss as is (pi_prox = the current weights)."""
    model, cfg = trainer.policy.model, trainer.grpo
    correction = behaviour_correction(cfg)
    low, high = cfg.clip_range
    if trainer.policy.lora is not None:
        with adapters_disabled(model):
            ref = policy_logprobs(model, batch.inputs, batch.targets, trainer.temperature)
    else:
        ref = policy_logprobs(trainer.ref_model, batch.inputs, batch.targets, trainer.temperature)

    def loss(inputs, targets):
        lp = policy_logprobs(model, inputs, targets, trainer.temperature)
        proximal = None if correction is None else mx.stop_gradient(lp)
        return grpo_loss(lp, batch.old_logprobs, batch.advantages, batch.mask, ref_logprobs=mx.stop_gradient(ref),
                         beta=cfg.beta, epsilon_low=low, epsilon_high=high, loss_type=cfg.loss_type, max_tokens=8,
                         proximal_logprobs=proximal, correction=correction or BehaviourCorrection())[0]

    value, grads = nn.value_and_grad(model, loss)(batch.inputs, batch.targets)
    return float(value), {k: np.array(v) for k, v in tree_flatten(grads)}


def assert_close_trees(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rel: float) -> None:
    assert got.keys() == want.keys()
    scale = np.sqrt(sum(float(np.sum(w.astype(np.float64) ** 2)) for w in want.values()))
    assert scale > 0
    for key in want:
        err = np.linalg.norm((got[key] - want[key]).astype(np.float64))
        assert err <= rel * max(np.linalg.norm(want[key].astype(np.float64)), 1e-3 * scale), key


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_accumulated_micro_batch_gradients_equal_the_one_batch_gradient(tiny_model_dir, loss_type, mode, compiled,
                                                                         objective):
    batch = varied_batch()
    trainer = trainer_for(tiny_model_dir, mode, loss_type=loss_type, compiled=compiled, objective=objective,
                          micro_batch_tokens=32, logprob_chunk_tokens=5)
    micro = split_batch(batch, trainer.micro_batch_tokens)
    assert len(micro) >= 4  # really accumulated, and chunked (K > 5 per micro-batch)
    want_loss, want = dense_gradients(trainer, batch)

    got = trainer.gradients(batch)
    assert float(got.loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert_close_trees({k: np.array(v) for k, v in tree_flatten(got.grads)}, want, rel=1e-5)


def spread_batch(seed: int, groups: int, group_size: int, low: int, high: int) -> TrainBatch:
    """Groups whose completions are `low`..`high` tokens long, each after a prompt of 12..60 tokens."""
    rng = np.random.default_rng(seed)
    made = []
    for b in range(groups):
        prompt = rng.integers(0, 10, int(rng.integers(12, 61))).astype(np.int32)
        records = [CompletionRecord(rng.integers(0, 10, n).astype(np.int32), -rng.uniform(1.5, 3.5, n).astype(np.float32),
                                    float(rng.random()), "length")
                   for n in rng.integers(low, high + 1, group_size).tolist()]
        made.append(AcceptedGroup(f"g{b}", b, prompt, records, 0, "a"))
    return build_train_batch(made)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_planned_micro_batches_of_lengths_16_to_512_give_the_one_batch_gradient(tiny_model_dir, mode):
    """Issue 38: completions spread 16..512 tokens, cut into micro-batches by length, train as one padded batch."""
    batch = spread_batch(3, groups=2, group_size=4, low=16, high=512)
    trainer = trainer_for(tiny_model_dir, mode, loss_type="dapo", micro_batch_tokens=1024, logprob_chunk_tokens=128)
    micro = split_batch(batch, trainer.micro_batch_tokens)
    widths = sorted({m.inputs.shape[1] for m in micro})
    assert len(micro) >= 3 and len(widths) >= 3  # really cut by length, not one padded batch
    want_loss, want = dense_gradients(trainer, batch)

    got = trainer.gradients(batch)
    assert float(got.loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert_close_trees({k: np.array(v) for k, v in tree_flatten(got.grads)}, want, rel=1e-4)


def test_compiled_traces_stay_bounded_and_untraced_shapes_run_eager(tiny_model_dir):
    """Past `max_compiled_shapes` signatures new micro-batch shapes run eager, with the same gradients."""
    batch = varied_batch()
    eager = trainer_for(tiny_model_dir, "lora", micro_batch_tokens=80)
    capped = trainer_for(tiny_model_dir, "lora", compiled=True, micro_batch_tokens=80, max_compiled_shapes=1)
    micro = split_batch(batch, 80)
    shapes = {tuple(a.shape for a in (m.inputs, m.positions, m.layout)) for m in micro}
    assert len(shapes) > 1  # the batch really has more shapes than the cap
    want, got = eager.gradients(batch), capped.gradients(batch)
    assert capped.compiled_update is not None and len(capped.compiled_update.shapes) == 1
    capped.gradients(batch)  # a second pass traces nothing new
    assert capped.compiled_update is not None and len(capped.compiled_update.shapes) == 1
    assert_close_trees({k: np.array(v) for k, v in tree_flatten(got.grads)},
                       {k: np.array(v) for k, v in tree_flatten(want.grads)}, rel=1e-5)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_micro_batch_size_does_not_change_the_step(tiny_model_dir, mode):
    batch = varied_batch(seed=1)
    one = trainer_for(tiny_model_dir, mode, loss_type="dapo", micro_batch_tokens=4096)
    many = trainer_for(tiny_model_dir, mode, loss_type="dapo", micro_batch_tokens=16, logprob_chunk_tokens=2)
    start = {k: np.array(v) for k, v in trainable_weights(one.policy.model).items()}
    stats_one, stats_many = one.step(batch), many.step(batch)
    assert stats_one.micro_batches == 1 and stats_many.micro_batches == 12
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "policy_objective", "ratio_mean", "offpolicy_gap_mean",
                "offpolicy_gap_max", "is_capped_fraction"):
        assert getattr(stats_many, key) == pytest.approx(getattr(stats_one, key), rel=1e-5, abs=1e-6), key
    # Adam's first step is about lr * sign(g), so entries with a near-zero gradient may
    # differ by up to 2 lr; the update as a whole must agree.
    update = {k: np.array(v) - start[k] for k, v in trainable_weights(one.policy.model).items()}
    other = {k: np.array(v) - start[k] for k, v in trainable_weights(many.policy.model).items()}
    diff = np.sqrt(sum(np.sum((other[k] - update[k]) ** 2) for k in update))
    assert diff <= 1e-3 * np.sqrt(sum(np.sum(u ** 2) for u in update.values()))


def snapshot(trainer: Trainer) -> dict[str, np.ndarray]:
    weights = {f"w.{k}": np.array(v) for k, v in trainable_weights(trainer.policy.model).items()}
    return {**weights, **{f"opt.{k}": v for k, v in flat_state(trainer).items()}}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("poison, reason", [("nan_old_logprob", "nonfinite_loss"), ("huge_advantage", "nonfinite_grad")])
def test_nonfinite_step_is_skipped_and_changes_nothing(tiny_model_dir, contrast_completions, poison, reason, compiled):
    trainer = trainer_for(tiny_model_dir, "full", compiled=compiled)
    good = on_policy_batch(trainer.policy, *contrast_completions)
    assert trainer.step(good).skipped is None  # nonzero moments, so "unchanged" means something
    bad = on_policy_batch(trainer.policy, *contrast_completions)
    if poison == "nan_old_logprob":
        old = np.array(bad.old_logprobs)
        old[0, np.flatnonzero(np.array(bad.mask)[0])[0]] = np.nan
        bad.old_logprobs = mx.array(old)
    else:
        # Opposite advantages cancel in the loss, but their gradients overflow fp32.
        bad.advantages = mx.array([1e37, -1e37])
    before = snapshot(trainer)

    stats = trainer.step(bad)

    assert stats.skipped == reason
    after = snapshot(trainer)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert int(trainer.optimizer.state["step"]) == 1
    assert trainer.step(good).skipped is None  # and the trainer carries on normally


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grad_checkpoint_does_not_change_the_gradients(tiny_model_dir, restore_llama_blocks, compiled):
    batch = varied_batch(seed=2)
    want = trainer_for(tiny_model_dir, "full", loss_type="gspo", compiled=compiled, micro_batch_tokens=48).gradients(batch)
    unpatched = restore_llama_blocks.__call__
    trainer = trainer_for(tiny_model_dir, "full", loss_type="gspo", compiled=compiled, micro_batch_tokens=48,
                          grad_checkpoint=True)
    assert restore_llama_blocks.__call__ is not unpatched
    got = trainer.gradients(batch)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    assert_close_trees({k: np.array(v) for k, v in tree_flatten(got.grads)},
                       {k: np.array(v) for k, v in tree_flatten(want.grads)}, rel=1e-5)


def test_memory_limit_is_applied_to_mlx(tiny_model_dir):
    previous = mx.get_memory_limit()
    try:
        trainer_for(tiny_model_dir, "lora", memory_limit_bytes=3 << 30)
        assert mx.get_memory_limit() == 3 << 30
    finally:
        mx.set_memory_limit(previous)


def test_trainer_from_config_carries_the_memory_settings(tiny_model_dir):
    from grpo_fleet.config import RunConfig
    from grpo_fleet.learner.step.trainer import trainer_from_config

    cfg = RunConfig.model_validate({"train": {"micro_batch_tokens": 64, "logprob_chunk_tokens": 8, "compile": False},
                                    "generation": {"temperature": 0.7}, "grpo": {"beta": 0.0}})
    trainer = trainer_from_config(make_policy(tiny_model_dir, "full"), cfg)
    assert (trainer.micro_batch_tokens, trainer.chunk_tokens, trainer.compiled, trainer.temperature) == (64, 8, False, 0.7)
    assert trainer.step(varied_batch()).micro_batches == 3  # 12 rows of width 16, 4 per 64 tokens


# ------------------------------------------------------ decoupled objective


def masked_ratio_mean(log_ratio: np.ndarray, mask: np.ndarray) -> float:
    return float((np.exp(log_ratio) * mask).sum() / mask.sum())


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_decoupled_one_epoch_gets_pi_prox_free_and_reports_the_gap(tiny_model_dir, mode):
    batch = varied_batch(seed=3)
    trainer = trainer_for(tiny_model_dir, mode, micro_batch_tokens=48)
    before = np.array(policy_logprobs(trainer.policy.model, batch.inputs, batch.targets, trainer.temperature))
    stats = trainer.step(batch)
    mask, behaviour = np.array(batch.mask), np.array(batch.old_logprobs)
    assert stats.proximal_seconds == 0.0 and stats.micro_batches > 1  # no extra forward
    # pi_theta / pi_prox is exactly 1 in the only epoch, so nothing is clipped...
    assert stats.ratio_mean == 1.0 and stats.clip_fraction == 0.0
    # ...and pi_prox is the policy before the update, on the batch's grid.
    assert stats.proximal_logprobs is not None
    np.testing.assert_allclose(stats.proximal_logprobs, before * mask, atol=1e-5)
    gap = np.abs(before - behaviour)[mask > 0]
    assert stats.offpolicy_gap_mean == pytest.approx(gap.mean(), rel=1e-5)
    assert stats.offpolicy_gap_max == pytest.approx(gap.max(), rel=1e-5)
    capped = (np.exp(np.clip(before - behaviour, -20, 20)) > trainer.grpo.is_cap)[mask > 0].mean()
    assert stats.is_capped_fraction == pytest.approx(capped) and 0 < capped < 1


def test_decoupled_two_epochs_clip_against_the_weights_before_the_step(tiny_model_dir):
    """ppo_epochs = 2 runs one no-grad pi_prox forward first; the second epoch's ratio is pi_theta(W1) / pi(W0)."""
    batch = varied_batch(seed=4)
    one = trainer_for(tiny_model_dir, "lora", micro_batch_tokens=48)
    two = trainer_for(tiny_model_dir, "lora", micro_batch_tokens=48, ppo_epochs=2)
    before = np.array(policy_logprobs(two.policy.model, batch.inputs, batch.targets, two.temperature))
    one.step(batch)  # the same first update as `two`'s first epoch (the same pi_prox, weights and optimizer)
    after_first = np.array(policy_logprobs(one.policy.model, batch.inputs, batch.targets, one.temperature))

    stats = two.step(batch)

    mask = np.array(batch.mask)
    assert stats.epochs == 2 and stats.skipped is None and stats.proximal_seconds > 0
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "policy_objective", "ratio_mean", "offpolicy_gap_mean",
                "offpolicy_gap_max", "is_capped_fraction"):
        assert np.isfinite(getattr(stats, key)), key
    assert stats.proximal_logprobs is not None
    np.testing.assert_allclose(stats.proximal_logprobs, before * mask, atol=1e-5)
    # Epoch 1 has ratio 1; epoch 2 is against W0, not W1 (ratio 1 again) nor pi_behav (far off).
    second = masked_ratio_mean(after_first - before, mask)
    assert abs(second - 1.0) > 1e-3
    assert stats.ratio_mean == pytest.approx((1.0 + second) / 2, rel=1e-4)
    behaviour_ratio = masked_ratio_mean(after_first - np.array(batch.old_logprobs), mask)
    assert abs(stats.ratio_mean - (1.0 + behaviour_ratio) / 2) > 1e-2


def test_coupled_objective_reports_the_gap_but_caps_nothing(tiny_model_dir):
    batch = varied_batch(seed=3)
    coupled = trainer_for(tiny_model_dir, "full", objective="coupled").step(batch)
    decoupled = trainer_for(tiny_model_dir, "full").step(batch)
    assert coupled.is_capped_fraction == 0.0 and decoupled.is_capped_fraction > 0
    assert coupled.offpolicy_gap_mean == pytest.approx(decoupled.offpolicy_gap_mean, rel=1e-6)
    assert coupled.ratio_mean != 1.0 and coupled.loss != pytest.approx(decoupled.loss)



@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_a_lie_the_step_sees_in_its_own_forward_drops_the_step(tiny_model_dir, contrast_completions, compiled, ppo_epochs):
    """The fused check: on-policy groups pass and the step applies; one spiked token drops the gradients untouched."""
    trainer = make_trainer(tiny_model_dir, "full", ppo_epochs=ppo_epochs, compile=compiled)
    bound = check_bounds_array([GapBound(1.0, 0.05)])  # a loose mean: the one token must decide
    honest = on_policy_batch(trainer.policy, *contrast_completions)
    honest.check = bound
    stats = trainer.step(honest)
    assert stats.skipped is None and [c.broke for c in stats.checked] == [None]
    assert stats.checked[0].worst < 1e-4  # the same weights, the same logprobs
    lying = on_policy_batch(trainer.policy, *contrast_completions)
    old = np.array(lying.old_logprobs)
    old[1, np.flatnonzero(np.array(lying.mask)[1])[-1]] += 3.0  # one token of one completion
    lying.old_logprobs = mx.array(old)
    lying.check = bound
    before = snapshot(trainer)

    stats = trainer.step(lying)

    assert stats.skipped == LOGPROB_MISMATCH and [c.broke for c in failed_checks(stats)] == ["token"]
    assert stats.epochs == 1
    after = snapshot(trainer)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    lying.check = None  # unchecked, the same batch trains: the check is what stopped it
    assert trainer.step(lying).skipped is None


def test_a_loss_without_the_policy_logprobs_is_still_checked_in_the_step(tiny_model_dir, contrast_completions):
    """A loss that gives no policy logprobs costs a checked step one no-grad forward, not its check."""
    policy = make_policy(tiny_model_dir, "lora")

    def plain_loss(model, micro, ref, totals, /, **kwargs):
        out = default_loss(model, micro, ref, totals, **kwargs)
        return LossOutput(out.loss, out.statistics)

    trainer = Trainer(policy, GRPOConfig(beta=0.0, groups_per_step=1), OptimConfig(lr=1e-3), temperature=TEMPERATURE,
                      max_tokens=MAX_TOKENS, loss=Loss("plain", plain_loss, gives_policy_logprobs=False))
    lying = assert_checked_in_the_step(trainer, contrast_completions)
    lying.check = None
    assert trainer.step(lying).proximal_seconds == 0.0, "unchecked, the loss's own forward is the only one"


def assert_checked_in_the_step(trainer: Trainer, completions: tuple[list[list[int]], list[float]]) -> TrainBatch:
    """An honest on-policy group passes the step's own check and trains; the same group with every reported logprob
    0.02 nats low breaks the mean bound and applies nothing. Returns the lying batch."""
    bound = check_bounds_array([GapBound(0.001, 0.05)])
    honest = on_policy_batch(trainer.policy, *completions)
    honest.check = bound
    stats = trainer.step(honest)
    assert stats.skipped is None and [c.broke for c in stats.checked] == [None] and stats.checked[0].worst < 1e-4
    lying = on_policy_batch(trainer.policy, *completions)
    lying.old_logprobs = lying.old_logprobs - 0.02 * lying.mask
    lying.check = bound
    before = snapshot(trainer)
    stats = trainer.step(lying)
    assert stats.skipped == LOGPROB_MISMATCH and [c.broke for c in failed_checks(stats)] == ["mean"]
    after = snapshot(trainer)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    return lying




def test_statistics_a_loss_leaves_out_are_absent_not_zero(tiny_model_dir, contrast_completions):
    """A loss that computes no kl, clip fraction, ratio or objective leaves them None in the step's stats (and in
    metrics.jsonl), never 0.0; a statistic of its own goes to `extra`."""
    policy = make_policy(tiny_model_dir, "lora")

    def bare_loss(model, micro, ref, totals, /, **kwargs):
        out = default_loss(model, micro, ref, totals, **kwargs)
        return LossOutput(out.loss, {"entropy_proxy": out.statistics["kl"]}, out.policy_logprobs)

    trainer = Trainer(policy, GRPOConfig(beta=0.0, groups_per_step=1), OptimConfig(lr=1e-3), temperature=TEMPERATURE,
                      max_tokens=MAX_TOKENS, loss=Loss("bare", bare_loss, gives_policy_logprobs=True))
    stats = trainer.step(on_policy_batch(policy, *contrast_completions))
    assert (stats.kl, stats.clip_fraction, stats.ratio_mean, stats.policy_objective) == (None, None, None, None)
    assert set(stats.extra) == {"entropy_proxy"} and stats.skipped is None and np.isfinite(stats.loss)
    default = Trainer(policy, GRPOConfig(beta=0.0, groups_per_step=1), OptimConfig(lr=1e-3), temperature=TEMPERATURE,
                      max_tokens=MAX_TOKENS).step(on_policy_batch(policy, *contrast_completions))
    assert None not in (default.kl, default.clip_fraction, default.ratio_mean, default.policy_objective)
