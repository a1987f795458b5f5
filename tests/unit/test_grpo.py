"""Tests for grpo_fleet.learner.step.grpo against the float64 NumPy reference."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from grpo_reference import (
    ref_behaviour_weights,
    ref_group_advantages,
    ref_grpo_loss,
    ref_kl_k3,
    ref_offpolicy_stats,
    ref_overlong_penalty,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_fleet.learner.step.advantages import group_advantages, overlong_penalty
from grpo_fleet.learner.step.grpo import BehaviourCorrection, behaviour_weights, grpo_loss, kl_k3, masked_mean
from grpo_fleet.learner.step.logprobs import token_logprobs
from grpo_fleet.learner.step.offpolicy import log_gap, offpolicy_stats

ATOL = 1e-5
RTOL = 1e-5
LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "gspo"]
STAT_KEYS = ["clip_fraction", "kl", "policy_objective", "ratio_mean"]


# ----------------------------------------------------------------- helpers


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype != mx.bool_ else x)


def _mx(x: np.ndarray) -> mx.array:
    return mx.array(np.asarray(x, dtype=np.float32))


def make_batch(
    rng: np.random.Generator, b: int, t: int, *, empty_row: bool = False, spread: float = 0.3
) -> dict[str, np.ndarray]:
    """Random float32-representable batch; row 0 has a single token, padding at the end."""
    lp = -rng.uniform(0.05, 3.0, size=(b, t))
    old = lp + rng.normal(0.0, spread, size=(b, t))
    ref = lp + rng.normal(0.0, spread, size=(b, t))
    adv = rng.normal(size=b)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = 1
    if empty_row and b > 1:
        lengths[-1] = 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    # The proximal policy sits between the behaviour one (old) and the current one (lp).
    prox = lp + rng.normal(0.0, spread, size=(b, t))
    batch = {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask, "prox": prox}
    # Round through float32 so both implementations see identical inputs.
    return {k: v.astype(np.float32).astype(np.float64) for k, v in batch.items()}


CORRECTION_KEYS = ("is_cap", "is_mode", "is_level")


def mx_loss(
    batch: dict[str, np.ndarray], lp: Any = None, *, use_ref: bool = False, use_prox: bool = False, **kw: Any
) -> tuple[mx.array, dict[str, mx.array]]:
    """grpo_loss on a NumPy batch; `lp` (an mx array) overrides batch["lp"] for grad tests.

    `use_prox` makes it decoupled against batch["prox"]; the reference's is_cap / is_mode /
    is_level keywords become a BehaviourCorrection.
    """
    names = {"is_cap": "cap", "is_mode": "mode", "is_level": "level"}
    correction = BehaviourCorrection(**{names[k]: kw.pop(k) for k in CORRECTION_KEYS if k in kw})
    return grpo_loss(
        _mx(batch["lp"]) if lp is None else lp,
        _mx(batch["old"]),
        _mx(batch["adv"]),
        _mx(batch["mask"]),
        ref_logprobs=_mx(batch["ref"]) if use_ref else None,
        proximal_logprobs=_mx(batch["prox"]) if use_prox else None,
        correction=correction,
        **kw,
    )


def run_both(batch: dict[str, np.ndarray], **kw: Any) -> tuple[float, dict, float, dict]:
    """Evaluate the mx loss and the reference on the same batch and options."""
    use_ref, use_prox = kw.pop("use_ref", False), kw.pop("use_prox", False)
    ref_lp = batch["ref"] if use_ref else None
    loss, stats = mx_loss(batch, use_ref=use_ref, use_prox=use_prox, **dict(kw))
    want, want_stats = ref_grpo_loss(
        batch["lp"], batch["old"], batch["adv"], batch["mask"], ref_logprobs=ref_lp,
        proximal_logprobs=batch["prox"] if use_prox else None, **kw,
    )
    return loss.item(), {k: v.item() for k, v in stats.items()}, want, want_stats


def assert_matches_reference(batch: dict[str, np.ndarray], **kw: Any) -> None:
    got, got_stats, want, want_stats = run_both(batch, **kw)
    assert math.isfinite(got)
    assert got == pytest.approx(want, abs=ATOL, rel=RTOL)
    for key in STAT_KEYS:
        assert got_stats[key] == pytest.approx(want_stats[key], abs=ATOL, rel=RTOL), key


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ------------------------------------------------------- group advantages


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_matches_reference(seed: int, scale_by_std: bool) -> None:
    rng = np.random.default_rng(seed)
    group_size = int(rng.integers(1, 9))
    groups = int(rng.integers(1, 7))
    rewards = rng.normal(size=groups * group_size).astype(np.float32)
    if groups > 1:
        rewards[:group_size] = 0.7  # one zero-variance group
    got = _np(group_advantages(mx.array(rewards), group_size, scale_by_std=scale_by_std))
    want = ref_group_advantages(rewards, group_size, scale_by_std=scale_by_std)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, -7.3, 0.0, 1e6 + 0.1])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_zero_variance_group_is_exactly_zero(value: float, scale_by_std: bool) -> None:
    # Values whose float32 mean may not round-trip exactly; must still give 0.0.
    rewards = mx.array([value] * 7 + [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=mx.float32)
    adv = _np(group_advantages(rewards, 7, scale_by_std=scale_by_std))
    assert np.all(adv[:7] == 0.0)
    assert np.any(adv[7:] != 0.0)


def test_group_advantages_binary_rewards_known_values() -> None:
    rewards = mx.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = _np(group_advantages(rewards, 4, eps=0.0))
    # mean 0.25, std sqrt(0.1875)
    s = math.sqrt(0.1875)
    np.testing.assert_allclose(adv[:4], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rtol=1e-6)
    assert np.all(adv[4:] == 0.0)
    centered = _np(group_advantages(rewards, 4, scale_by_std=False))
    np.testing.assert_allclose(centered[:4], [0.75, -0.25, -0.25, -0.25])


def test_group_advantages_eps_and_int_rewards() -> None:
    rewards = mx.array([0, 2, 4, 6])  # integer dtype is accepted and promoted
    got = group_advantages(rewards, 4, eps=0.5)
    assert got.dtype == mx.float32
    want = ref_group_advantages(np.array([0, 2, 4, 6]), 4, eps=0.5)
    np.testing.assert_allclose(_np(got), want, rtol=1e-6)


def test_group_advantages_sums_to_zero_per_group(rng: np.random.Generator) -> None:
    rewards = rng.normal(size=24).astype(np.float32)
    adv = _np(group_advantages(mx.array(rewards), 6)).reshape(4, 6)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)


@pytest.mark.parametrize("n, group_size", [(10, 4), (5, 2), (3, 0), (4, -1)])
def test_group_functions_reject_bad_group_size(n: int, group_size: int) -> None:
    rewards = mx.zeros((n,))
    with pytest.raises(ValueError):
        group_advantages(rewards, group_size)


def test_group_advantages_rejects_2d_rewards() -> None:
    with pytest.raises(ValueError):
        group_advantages(mx.zeros((2, 4)), 4)


# ----------------------------------------------------- k3, masked mean


def test_kl_k3_matches_reference(rng: np.random.Generator) -> None:
    lp = -rng.uniform(0.0, 4.0, size=(3, 7)).astype(np.float32)
    ref = -rng.uniform(0.0, 4.0, size=(3, 7)).astype(np.float32)
    got = _np(kl_k3(mx.array(lp), mx.array(ref)))
    np.testing.assert_allclose(got, ref_kl_k3(lp, ref), atol=ATOL, rtol=RTOL)
    assert np.all(got >= -1e-6)
    assert np.all(_np(kl_k3(mx.array(lp), mx.array(lp))) == 0.0)


def test_masked_mean() -> None:
    x = mx.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = mx.array([[1, 1, 0], [0, 0, 0]], dtype=mx.bool_)
    assert masked_mean(x, m).item() == pytest.approx(1.5)
    np.testing.assert_allclose(_np(masked_mean(x, m, axis=1)), [1.5, 0.0])


# ------------------------------------------------------------- grpo loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("seed", range(2))
def test_grpo_loss_matches_reference(
    loss_type: str, beta: float, epsilon_high: Any, seed: int
) -> None:
    rng = np.random.default_rng(100 + seed)
    b, t = int(rng.integers(2, 7)), int(rng.integers(1, 9))
    batch = make_batch(rng, b, t, empty_row=True)
    assert_matches_reference(
        batch,
        use_ref=beta > 0,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        max_tokens=t + 3,
    )


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    b=st.integers(1, 6),
    t=st.integers(1, 10),
    seed=st.integers(0, 2**16),
    loss_type=st.sampled_from(LOSS_TYPES),
    beta=st.sampled_from([0.0, 0.04]),
    eps=st.tuples(st.floats(0.05, 0.4), st.floats(0.05, 0.5)),
    spread=st.sampled_from([0.05, 0.3, 1.0]),
)
def test_grpo_loss_property(
    b: int, t: int, seed: int, loss_type: str, beta: float, eps: tuple[float, float], spread: float
) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, b, t, spread=spread)
    # Random (non-prefix) masks too, keeping at least one token per row.
    if seed % 2:
        mask = rng.random((b, t)) < 0.6
        mask[np.arange(b), rng.integers(0, t, size=b)] = True
        batch["mask"] = mask.astype(np.float64)
    assert_matches_reference(
        batch,
        use_ref=True,
        beta=beta,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        loss_type=loss_type,
        max_tokens=t,
    )


def test_fully_masked_row_counts_as_zero_in_grpo(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 4, 6, empty_row=True)
    assert batch["mask"][-1].sum() == 0
    got, _, want, _ = run_both(batch, loss_type="grpo")
    # The empty row still counts in the mean over B, with zero contribution.
    keys = ("lp", "old", "adv", "mask")
    rows = [ref_grpo_loss(*(batch[k][i : i + 1] for k in keys))[0] for i in range(3)]
    assert got == pytest.approx(want, abs=ATOL)
    assert got == pytest.approx(sum(rows) / 4, abs=ATOL)


def test_single_token_rows(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 3, 5)
    batch["mask"] = np.zeros((3, 5))
    batch["mask"][[0, 1, 2], [0, 2, 4]] = 1.0
    for loss_type in LOSS_TYPES:
        assert_matches_reference(batch, loss_type=loss_type, max_tokens=5, use_ref=True, beta=0.1)


def test_bool_mask_equals_float_mask(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 4, 6)
    args = (_mx(batch["lp"]), _mx(batch["old"]), _mx(batch["adv"]))
    for loss_type in LOSS_TYPES:
        a, _ = grpo_loss(*args, _mx(batch["mask"]), loss_type=loss_type, max_tokens=6)
        b, _ = grpo_loss(*args, mx.array(batch["mask"] > 0), loss_type=loss_type, max_tokens=6)
        assert a.item() == pytest.approx(b.item(), abs=1e-7)


def test_epsilon_high_none_means_symmetric(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 4, 6, spread=1.0)
    sym, sym_stats, _, _ = run_both(batch, epsilon_low=0.15)
    exp, exp_stats, _, _ = run_both(batch, epsilon_low=0.15, epsilon_high=0.15)
    wide, _, _, _ = run_both(batch, epsilon_low=0.15, epsilon_high=0.5)
    assert sym == exp and sym_stats == exp_stats
    assert wide != sym  # clip-higher changes the loss when ratios exceed 1.15


def test_beta_zero_ignores_reference_but_reports_kl(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 4, 6)
    no_ref, no_ref_stats, _, _ = run_both(batch)
    with_ref, with_ref_stats, _, want_stats = run_both(batch, use_ref=True, beta=0.0)
    with_kl, _, _, _ = run_both(batch, use_ref=True, beta=0.5)
    assert with_ref == pytest.approx(no_ref, abs=1e-7)
    assert no_ref_stats["kl"] == 0.0
    assert want_stats["kl"] > 0
    assert with_ref_stats["kl"] == pytest.approx(want_stats["kl"], abs=ATOL)
    # k3 >= 0, so a positive beta can only raise the loss.
    assert with_kl > no_ref


def test_loss_identities_at_ratio_one(rng: np.random.Generator) -> None:
    # On-policy (old == lp): ratio 1 everywhere, loss = -aggregate(A).
    batch = make_batch(rng, 5, 7)
    batch["old"] = batch["lp"].copy()
    m, adv = batch["mask"], batch["adv"]
    n = m.sum(axis=1)
    expected = {
        "grpo": -np.mean(adv * (n > 0)),
        "gspo": -np.mean(adv * (n > 0)),
        "dapo": -(adv * n).sum() / n.sum(),
        "dr_grpo": -(adv * n).sum() / (5 * 9),
    }
    for loss_type, want in expected.items():
        got, stats, _, _ = run_both(batch, loss_type=loss_type, max_tokens=9)
        assert got == pytest.approx(want, abs=ATOL)
        assert stats["clip_fraction"] == 0.0
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert stats["policy_objective"] == pytest.approx(-got, abs=ATOL)


def test_clip_fraction_with_forced_ratios() -> None:
    lp = np.full((2, 4), -1.0)
    log_r = np.log(np.array([[2.0, 1.25, 1.0, 1.1], [0.5, 0.85, 0.75, 1.0]]))
    old = lp - log_r
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=np.float64)
    adv = np.array([1.0, -1.0])
    batch = {"lp": lp, "old": old, "adv": adv, "mask": mask, "ref": lp}
    # eps 0.2/0.2: outside are 2.0, 1.25, 0.5, 0.75 -> 4 of 7 counted tokens.
    _, stats, _, _ = run_both(batch, epsilon_low=0.2)
    assert stats["clip_fraction"] == pytest.approx(4 / 7, abs=1e-6)
    # clip-higher 0.28 lets 1.25 through: 3 of 7.
    _, stats, _, want = run_both(batch, epsilon_low=0.2, epsilon_high=0.28)
    assert stats["clip_fraction"] == pytest.approx(3 / 7, abs=1e-6)
    assert want["clip_fraction"] == pytest.approx(3 / 7)
    # The padded token (ratio 1.0) would be inside anyway; make it an outlier to check masking.
    batch["old"][1, 3] = lp[1, 3] - np.log(5.0)
    _, stats, _, _ = run_both(batch, epsilon_low=0.2, epsilon_high=0.28)
    assert stats["clip_fraction"] == pytest.approx(3 / 7, abs=1e-6)


def test_clip_fraction_gspo_uses_sequence_ratio() -> None:
    lp = np.full((2, 4), -1.0)
    # Row 0: geometric mean of (2, 2, 1, 1) = sqrt(2) > 1.2 -> all 4 tokens outside.
    # Row 1: (1.3, 0.9, pad) -> geometric mean ~1.08 -> inside, even though 1.3 is not.
    log_r = np.log(np.array([[2.0, 2.0, 1.0, 1.0], [1.3, 0.9, 9.0, 9.0]]))
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.float64)
    batch = {"lp": lp, "old": lp - log_r, "adv": np.array([1.0, 1.0]), "mask": mask, "ref": lp}
    got, stats, want, want_stats = run_both(batch, loss_type="gspo")
    assert stats["clip_fraction"] == pytest.approx(4 / 6, abs=1e-6)
    row1 = math.sqrt(1.3 * 0.9)
    assert stats["ratio_mean"] == pytest.approx((4 * math.sqrt(2) + 2 * row1) / 6, abs=1e-5)
    # Positive advantage, ratio above 1 + eps: row 0 is clipped to 1.2.
    assert got == pytest.approx(-(1.2 + math.sqrt(1.3 * 0.9)) / 2, abs=1e-5)
    assert got == pytest.approx(want, abs=1e-5)


def test_garbage_in_padding_does_not_leak(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 4, 6)
    dirty = {k: v.copy() for k, v in batch.items()}
    pad = batch["mask"] == 0
    dirty["lp"][pad] = 200.0  # exp(400) would overflow to inf, and inf * 0 = NaN
    dirty["old"][pad] = -200.0
    dirty["ref"][pad] = -300.0
    for loss_type in LOSS_TYPES:
        kw = dict(loss_type=loss_type, max_tokens=6, beta=0.1)
        clean = mx_loss(batch, use_ref=True, **kw)
        loss, stats = mx_loss(dirty, use_ref=True, **kw)
        grad_fn = mx.grad(lambda lp: mx_loss(dirty, lp, use_ref=True, **kw)[0])  # noqa: B023
        grad = _np(grad_fn(_mx(dirty["lp"])))
        assert loss.item() == pytest.approx(clean[0].item(), abs=1e-6)
        for key in STAT_KEYS:
            assert stats[key].item() == pytest.approx(clean[1][key].item(), abs=1e-6), key
        assert np.all(np.isfinite(grad)) and np.all(grad[pad] == 0.0)


def test_stats_are_scalars(rng: np.random.Generator) -> None:
    batch = make_batch(rng, 3, 4)
    _, stats = grpo_loss(_mx(batch["lp"]), _mx(batch["old"]), _mx(batch["adv"]), _mx(batch["mask"]))
    assert set(STAT_KEYS) <= set(stats)
    assert all(v.shape == () for v in stats.values())


# ------------------------------------------------------------------ errors


def test_grpo_loss_argument_errors() -> None:
    lp = mx.zeros((2, 3))
    adv = mx.zeros((2,))
    mask = mx.ones((2, 3))
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(lp, lp, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="max_tokens"):
        grpo_loss(lp, lp, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, adv, mask, beta=0.1)
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, mx.zeros((3,)), mask)
    with pytest.raises(ValueError):
        grpo_loss(lp, mx.zeros((2, 4)), adv, mask)
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, adv, mx.ones((2, 4)))
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, adv, mask, ref_logprobs=mx.zeros((1, 3)), beta=0.1)
    with pytest.raises(ValueError):
        grpo_loss(mx.zeros((6,)), mx.zeros((6,)), mx.zeros((6,)), mx.ones((6,)))


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_at_ratio_one_is_analytic(loss_type: str, rng: np.random.Generator) -> None:
    # With old == lp and no KL: d loss / d lp_bt = -A_b * m_bt * w_b for the aggregation weight w_b.
    batch = make_batch(rng, 4, 5, empty_row=True)
    m, adv = batch["mask"], batch["adv"]
    n = m.sum(axis=1)
    weights = {
        "grpo": 1.0 / (4 * np.maximum(n, 1.0)),
        "gspo": 1.0 / (4 * np.maximum(n, 1.0)),
        "dapo": np.full(4, 1.0 / n.sum()),
        "dr_grpo": np.full(4, 1.0 / (4 * 8)),
    }[loss_type]

    def loss_fn(x: mx.array) -> mx.array:
        kw = dict(loss_type=loss_type, max_tokens=8)
        return grpo_loss(x, mx.stop_gradient(x), _mx(adv), _mx(m), **kw)[0]

    grad = mx.grad(loss_fn)(_mx(batch["lp"]))
    np.testing.assert_allclose(_np(grad), -(adv * weights)[:, None] * m, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_gradient_matches_finite_differences(loss_type: str, beta: float) -> None:
    rng = np.random.default_rng(7)
    batch = make_batch(rng, 3, 4, spread=0.4)
    kw = dict(beta=beta, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type, max_tokens=4)
    ref_lp = batch["ref"] if beta > 0 else None

    def f(lp: np.ndarray) -> float:
        return ref_grpo_loss(lp, batch["old"], batch["adv"], batch["mask"], ref_lp, **kw)[0]

    h = 1e-6
    numeric = np.zeros_like(batch["lp"])
    for idx in np.ndindex(*batch["lp"].shape):
        up, down = batch["lp"].copy(), batch["lp"].copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = (f(up) - f(down)) / (2 * h)

    grad_fn = mx.grad(lambda lp: mx_loss(batch, lp, use_ref=beta > 0, **kw)[0])
    analytic = _np(grad_fn(_mx(batch["lp"])))
    assert np.any(numeric != 0.0)
    np.testing.assert_allclose(analytic, numeric, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", STAT_KEYS)
def test_stats_carry_no_gradient(key: str, rng: np.random.Generator) -> None:
    batch = make_batch(rng, 3, 5)
    grad_fn = mx.grad(lambda lp: mx_loss(batch, lp, use_ref=True, beta=0.1)[1][key])
    grad = _np(grad_fn(_mx(batch["lp"])))
    assert np.all(grad == 0.0)


def _summed_logprobs(logits: mx.array, targets: mx.array) -> np.ndarray:
    return _np(mx.sum(token_logprobs(logits, targets), axis=1))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sgd_step_moves_logprobs_with_advantage_sign(
    loss_type: str, rng: np.random.Generator
) -> None:
    b, t, v = 2, 5, 7
    logits = mx.array(rng.normal(size=(b, t, v)).astype(np.float32))
    targets = mx.array(rng.integers(0, v, size=(b, t)))
    adv = mx.array([1.0, -1.0])
    mask = mx.ones((b, t))

    def loss_fn(params: mx.array) -> mx.array:
        lp = token_logprobs(params, targets)
        return grpo_loss(lp, mx.stop_gradient(lp), adv, mask, loss_type=loss_type, max_tokens=t)[0]

    before = _summed_logprobs(logits, targets)
    stepped = logits - 0.5 * mx.grad(loss_fn)(logits)
    after = _summed_logprobs(stepped, targets)
    assert after[0] > before[0]
    assert after[1] < before[1]


def test_sgd_step_on_linear_policy_with_value_and_grad(rng: np.random.Generator) -> None:
    b, t, v = 2, 4, 6
    mx.random.seed(0)
    policy = nn.Linear(b * t, v, bias=False)
    # Disjoint one-hot inputs per completion, so the rows do not share weights.
    inputs = mx.array(np.eye(b * t, dtype=np.float32).reshape(b, t, b * t))
    targets = mx.array(rng.integers(0, v, size=(b, t)))
    adv = mx.array([1.3, -0.7])
    mask = mx.array([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=mx.bool_)
    old = mx.stop_gradient(token_logprobs(policy(inputs), targets))

    def loss_fn(model: nn.Linear) -> mx.array:
        lp = token_logprobs(model(inputs), targets)
        return grpo_loss(lp, old, adv, mask)[0]

    def masked_sum() -> np.ndarray:
        return _np(mx.sum(token_logprobs(policy(inputs), targets) * mask, axis=1))

    before = masked_sum()
    loss, grads = nn.value_and_grad(policy, loss_fn)(policy)
    optimizer = optim.SGD(learning_rate=1.0)
    optimizer.update(policy, grads)
    mx.eval(policy.parameters())
    after = masked_sum()
    assert math.isfinite(loss.item())
    assert after[0] > before[0]
    assert after[1] < before[1]


# ------------------------------------------- micro-batch shares of the loss


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("use_ref", [False, True])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_shares_sum_to_the_whole_batch_reference(seed: int, use_ref: bool, loss_type: str) -> None:
    """With the batch totals, each row slice's loss and stats are additive shares of the batch values."""
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, 9, 6, empty_row=True, spread=0.5)
    kw: dict[str, Any] = dict(beta=0.05 if use_ref else 0.0, epsilon_high=0.28, loss_type=loss_type, max_tokens=6)
    want, want_stats = ref_grpo_loss(batch["lp"], batch["old"], batch["adv"], batch["mask"],
                                     ref_logprobs=batch["ref"] if use_ref else None, **kw)
    totals = mx.array([batch["mask"].sum(), 9.0])
    order = rng.permutation(9)
    loss, stats = mx.array(0.0), {key: mx.array(0.0) for key in STAT_KEYS}
    for rows in np.array_split(order, [2, 3, 7]):
        part = {k: v[rows] for k, v in batch.items()}
        share, share_stats = mx_loss(part, use_ref=use_ref, total_tokens=totals[0], total_sequences=totals[1], **kw)
        loss = loss + share
        stats = {key: stats[key] + share_stats[key] for key in STAT_KEYS}
    assert loss.item() == pytest.approx(want, abs=ATOL, rel=RTOL)
    for key in STAT_KEYS:
        assert stats[key].item() == pytest.approx(want_stats[key], abs=ATOL, rel=RTOL), key


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_an_extreme_old_logprob_cannot_overflow_the_loss(loss_type: str) -> None:
    # Negative advantage, old logprob at the door's floor: exp(-5 - -1e4) is inf in
    # float32, and the unclipped side of the surrogate would make the loss inf.
    lp = np.full((2, 3), -5.0)
    old = lp.copy()
    old[0, 1] = -1e4
    batch = {"lp": lp, "old": old, "adv": np.array([-1.0, 1.0]), "mask": np.ones((2, 3)), "ref": lp}
    got, _, want, _ = run_both(batch, loss_type=loss_type, max_tokens=3)
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-5)


# ----------------------------------------------- decoupled objective (AReaL)

IS_MODES = ["truncate", "mask"]
IS_LEVELS = ["token", "sequence"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("is_level", IS_LEVELS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_decoupled_loss_matches_reference(loss_type: str, is_mode: str, is_level: str, dual_clip: Any) -> None:
    rng = np.random.default_rng(7)
    batch = make_batch(rng, 6, 8, empty_row=True, spread=0.8)
    kw = dict(use_ref=True, beta=0.04, epsilon_high=0.28, loss_type=loss_type, max_tokens=9, dual_clip=dual_clip)
    cap = 1.5 if is_level == "token" else 1.1  # a sequence's geometric mean strays less than its tokens
    assert_matches_reference(batch, use_prox=True, is_cap=cap, is_mode=is_mode, is_level=is_level, **kw)
    # The weights really acted: some but not all tokens are beyond the cap.
    _, capped = ref_behaviour_weights(batch["prox"], batch["old"], batch["mask"], cap, is_mode, is_level)
    assert 0 < capped[batch["mask"] > 0].mean() < 1


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    b=st.integers(1, 6), t=st.integers(1, 10), seed=st.integers(0, 2**16),
    loss_type=st.sampled_from(LOSS_TYPES), is_mode=st.sampled_from(IS_MODES), is_level=st.sampled_from(IS_LEVELS),
    cap=st.floats(1.0, 5.0), spread=st.sampled_from([0.05, 0.3, 1.0]), dual_clip=st.sampled_from([None, 1.5, 3.0]),
)
def test_decoupled_loss_property(
    b: int, t: int, seed: int, loss_type: str, is_mode: str, is_level: str, cap: float, spread: float, dual_clip: Any
) -> None:
    batch = make_batch(np.random.default_rng(seed), b, t, spread=spread)
    assert_matches_reference(batch, use_prox=True, use_ref=True, beta=0.04, loss_type=loss_type, max_tokens=t,
                             is_cap=cap, is_mode=is_mode, is_level=is_level, dual_clip=dual_clip)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("is_level", IS_LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_decoupled_equals_coupled_exactly_when_behaviour_is_proximal(
    loss_type: str, is_mode: str, is_level: str, beta: float
) -> None:
    """pi_prox = pi_behav gives w = 1 on every token: the same loss, stats and gradient, bit for bit."""
    batch = make_batch(np.random.default_rng(3), 5, 7, empty_row=True, spread=0.6)
    batch["prox"] = batch["old"].copy()
    kw: dict[str, Any] = dict(use_ref=True, beta=beta, epsilon_high=0.28, loss_type=loss_type, max_tokens=7)
    correction = dict(is_cap=1.0, is_mode=is_mode, is_level=is_level)  # the tightest cap: w = 1 still passes
    coupled, coupled_stats = mx_loss(batch, **kw)
    decoupled, decoupled_stats = mx_loss(batch, use_prox=True, **correction, **kw)
    assert decoupled.item() == coupled.item()
    assert {k: v.item() for k, v in decoupled_stats.items()} == {k: v.item() for k, v in coupled_stats.items()}

    def grad(**extra: Any) -> np.ndarray:
        return _np(mx.grad(lambda lp: mx_loss(batch, lp, **extra, **kw)[0])(_mx(batch["lp"])))

    np.testing.assert_array_equal(grad(use_prox=True, **correction), grad())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_decoupled_gradient_at_ratio_one_is_the_weighted_policy_gradient(loss_type: str) -> None:
    """ppo_epochs = 1: pi_prox = stop_gradient(pi_theta), so d loss / d lp = -w * A * (aggregation weight)."""
    batch = make_batch(np.random.default_rng(11), 4, 5, spread=0.8)
    m, adv = batch["mask"], batch["adv"]
    n = m.sum(axis=1)
    per_row = {"grpo": 1.0 / (4 * n), "gspo": 1.0 / (4 * n), "dapo": np.full(4, 1.0 / n.sum()),
               "dr_grpo": np.full(4, 1.0 / (4 * 5))}[loss_type]
    weight, _ = ref_behaviour_weights(batch["lp"], batch["old"], m, 2.0, "truncate", "token")
    if loss_type == "gspo":
        # One ratio per sequence: every token's gradient carries the row's mean weight.
        weight = np.broadcast_to(((weight * m).sum(axis=1) / n)[:, None], m.shape)

    def loss_fn(x: mx.array) -> mx.array:
        return grpo_loss(x, _mx(batch["old"]), _mx(adv), _mx(m), proximal_logprobs=mx.stop_gradient(x),
                         loss_type=loss_type, max_tokens=5)[0]

    grad = _np(mx.grad(loss_fn)(_mx(batch["lp"])))
    np.testing.assert_allclose(grad, -(adv * per_row)[:, None] * weight * m, atol=1e-6)
    _, stats = grpo_loss(_mx(batch["lp"]), _mx(batch["old"]), _mx(adv), _mx(m), proximal_logprobs=_mx(batch["lp"]),
                         loss_type=loss_type, max_tokens=5)
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_decoupled_gradient_matches_finite_differences(loss_type: str, is_level: str) -> None:
    rng = np.random.default_rng(5)
    batch = make_batch(rng, 3, 4, spread=0.4)
    kw = dict(beta=0.2, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type, max_tokens=4, dual_clip=2.0,
              is_cap=1.3, is_level=is_level)

    def f(lp: np.ndarray) -> float:
        return ref_grpo_loss(lp, batch["old"], batch["adv"], batch["mask"], batch["ref"],
                             proximal_logprobs=batch["prox"], **kw)[0]

    h = 1e-6
    numeric = np.zeros_like(batch["lp"])
    for idx in np.ndindex(*batch["lp"].shape):
        up, down = batch["lp"].copy(), batch["lp"].copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = (f(up) - f(down)) / (2 * h)
    analytic = _np(mx.grad(lambda lp: mx_loss(batch, lp, use_ref=True, use_prox=True, **kw)[0])(_mx(batch["lp"])))
    assert np.any(numeric != 0.0)
    np.testing.assert_allclose(analytic, numeric, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("mode", IS_MODES)
def test_behaviour_weights_with_forced_ratios(mode: str, level: str) -> None:
    # Row 0 token weights (4, 1, 0.5); row 1 (3, 1) with a padded slot holding garbage.
    w = np.array([[4.0, 1.0, 0.5], [3.0, 1.0, 1e9]])
    behav = np.full((2, 3), -2.0)
    mask = np.array([[1, 1, 1], [1, 1, 0]], dtype=np.float64)
    prox = behav + np.log(w)
    got_w, got_capped = (_np(a) for a in behaviour_weights(_mx(prox), _mx(behav), _mx(mask),
                                                           BehaviourCorrection(2.0, mode, level)))
    want_w, want_capped = ref_behaviour_weights(prox, behav, mask, 2.0, mode, level)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
    np.testing.assert_array_equal(got_capped, want_capped)
    if level == "token":
        expected = [[2.0, 1.0, 0.5], [2.0, 1.0, 1.0]] if mode == "truncate" else [[0.0, 1.0, 0.5], [0.0, 1.0, 1.0]]
        np.testing.assert_allclose(got_w, expected, rtol=1e-6)
    else:
        # Geometric means: (4 * 1 * 0.5)^(1/3) = 1.26 stays; sqrt(3) = 1.73 stays too (below the cap of 2).
        np.testing.assert_allclose(got_w[0], [2 ** (1 / 3)] * 3, rtol=1e-6)
        np.testing.assert_allclose(got_w[1, :2], [math.sqrt(3)] * 2, rtol=1e-6)
        assert not got_capped.any()


def test_masked_tokens_keep_their_place_in_the_normaliser() -> None:
    """MIS zeroes a token's surrogate; dapo's denominator still counts it (fixed before any forward)."""
    lp = np.full((1, 4), -1.0)
    old = lp - np.log(np.array([[1.0, 1.0, 1.0, 5.0]]))  # pi_prox / pi_behav = 5 on the last token
    batch = {"lp": lp, "old": old, "prox": lp.copy(), "adv": np.array([1.0]), "mask": np.ones((1, 4)), "ref": lp}
    loss, _ = mx_loss(batch, use_prox=True, loss_type="dapo", is_cap=2.0, is_mode="mask")
    assert loss.item() == pytest.approx(-3.0 / 4.0)
    loss, _ = mx_loss(batch, use_prox=True, loss_type="dapo", is_cap=2.0, is_mode="truncate")
    assert loss.item() == pytest.approx(-(3.0 + 2.0) / 4.0)


def test_a_nan_behaviour_logprob_is_not_silently_weighted_zero() -> None:
    batch = make_batch(np.random.default_rng(0), 2, 3)
    batch["old"][0, 0] = np.nan
    for mode in IS_MODES:
        loss, _ = mx_loss(batch, use_prox=True, is_mode=mode)
        assert math.isnan(loss.item())


def test_dual_clip_bounds_negative_advantage_tokens() -> None:
    lp = np.zeros((2, 2)) - 1.0
    old = lp - np.log(np.array([[10.0, 1.1], [10.0, 0.5]]))  # ratios 10 and 1.1 / 10 and 0.5
    batch = {"lp": lp, "old": old, "adv": np.array([-1.0, 1.0]), "mask": np.ones((2, 2)), "ref": lp}
    plain, _, _, _ = run_both(batch, loss_type="dapo")
    got, _, want, _ = run_both(batch, loss_type="dapo", dual_clip=3.0)
    # Row 0 (A = -1): ratio 10 contributes -3 instead of -10; ratio 1.1 is untouched (-1.1).
    # Row 1 (A = +1): min(10, 1.2) = 1.2 and 0.5, as without dual-clip.
    assert plain == pytest.approx(-(-10.0 - 1.1 + 1.2 + 0.5) / 4)
    assert got == pytest.approx(-(-3.0 - 1.1 + 1.2 + 0.5) / 4) and got == pytest.approx(want)
    grad = _np(mx.grad(lambda x: mx_loss(batch, x, loss_type="dapo", dual_clip=3.0)[0])(_mx(lp)))
    assert grad[0, 0] == 0.0 and grad[0, 1] != 0.0  # the bound is a constant: no gradient through it


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_decoupled_micro_batch_shares_sum_to_the_whole_batch_reference(seed: int, loss_type: str) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, 9, 6, empty_row=True, spread=0.7)
    kw: dict[str, Any] = dict(beta=0.05, epsilon_high=0.28, loss_type=loss_type, max_tokens=6, dual_clip=3.0,
                              is_mode="mask", is_level="sequence", is_cap=1.5)
    want, want_stats = ref_grpo_loss(batch["lp"], batch["old"], batch["adv"], batch["mask"], ref_logprobs=batch["ref"],
                                     proximal_logprobs=batch["prox"], **kw)
    totals = mx.array([batch["mask"].sum(), 9.0])
    loss, stats = mx.array(0.0), {key: mx.array(0.0) for key in STAT_KEYS}
    for rows in np.array_split(rng.permutation(9), [2, 3, 7]):
        part = {k: v[rows] for k, v in batch.items()}
        share, share_stats = mx_loss(part, use_ref=True, use_prox=True, total_tokens=totals[0],
                                     total_sequences=totals[1], **dict(kw))
        loss = loss + share
        stats = {key: stats[key] + share_stats[key] for key in STAT_KEYS}
    assert loss.item() == pytest.approx(want, abs=ATOL, rel=RTOL)
    for key in STAT_KEYS:
        assert stats[key].item() == pytest.approx(want_stats[key], abs=ATOL, rel=RTOL), key


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("mode", IS_MODES)
def test_offpolicy_stats_match_reference(mode: str, level: str) -> None:
    batch = make_batch(np.random.default_rng(2), 5, 6, spread=0.8)
    batch["prox"][batch["mask"] == 0] = 50.0  # garbage off the mask must not reach the max
    args = (_mx(batch["prox"]), _mx(batch["old"]), _mx(batch["mask"]))
    got = {k: v.item() for k, v in offpolicy_stats(*args, BehaviourCorrection(1.5, mode, level)).items()}
    want = ref_offpolicy_stats(batch["prox"], batch["old"], batch["mask"], 1.5, mode, level)
    assert got == pytest.approx(want, rel=1e-5)
    assert 0 < got["is_capped_fraction"] < 1
    coupled = offpolicy_stats(*args, None)
    assert coupled["is_capped_fraction"].item() == 0.0
    assert coupled["offpolicy_gap_max"].item() == pytest.approx(want["offpolicy_gap_max"], rel=1e-6)
    assert np.all(_np(log_gap(*args))[batch["mask"] == 0] == 0.0)


def test_behaviour_correction_and_loss_option_errors() -> None:
    for bad in (dict(cap=0.5), dict(mode="clip"), dict(level="group")):
        with pytest.raises(ValueError):
            BehaviourCorrection(**bad)  # type: ignore[arg-type]
    lp, adv, mask = mx.zeros((2, 3)), mx.zeros((2,)), mx.ones((2, 3))
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(lp, lp, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        grpo_loss(lp, lp, adv, mask, proximal_logprobs=mx.zeros((2, 4)))


# ------------------------------------------------------ overlong penalty


def test_overlong_penalty_matches_reference() -> None:
    lengths = np.arange(0, 21)
    got = _np(overlong_penalty(mx.array(lengths), max_tokens=20, buffer=8, factor=0.5))
    want = ref_overlong_penalty(lengths, 20, 8, 0.5)
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.all(got[:13] == 0.0) and got[20] == pytest.approx(-0.5) and got[16] == pytest.approx(-0.25)
    assert _np(overlong_penalty(mx.array([25]), 20, 8, 1.0))[0] == pytest.approx(-1.0)  # never below -factor


@pytest.mark.parametrize("buffer, factor", [(0, 1.0), (20, 1.0), (4, -1.0)])
def test_overlong_penalty_refuses_bad_settings(buffer: int, factor: float) -> None:
    with pytest.raises(ValueError):
        overlong_penalty(mx.array([3, 5]), max_tokens=20, buffer=buffer, factor=factor)
