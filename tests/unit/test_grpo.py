"""Tests for grpo_fleet.learner.grpo against the float64 NumPy reference."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from grpo_reference import (
    ref_group_advantages,
    ref_grpo_loss,
    ref_kl_k3,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_fleet.learner.grpo import (
    group_advantages,
    grpo_loss,
    kl_k3,
    masked_mean,
)
from grpo_fleet.learner.logprobs import token_logprobs

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
    batch = {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask}
    # Round through float32 so both implementations see identical inputs.
    return {k: v.astype(np.float32).astype(np.float64) for k, v in batch.items()}


def mx_loss(
    batch: dict[str, np.ndarray], lp: Any = None, *, use_ref: bool = False, **kw: Any
) -> tuple[mx.array, dict[str, mx.array]]:
    """grpo_loss on a NumPy batch; `lp` (an mx array) overrides batch["lp"] for grad tests."""
    return grpo_loss(
        _mx(batch["lp"]) if lp is None else lp,
        _mx(batch["old"]),
        _mx(batch["adv"]),
        _mx(batch["mask"]),
        ref_logprobs=_mx(batch["ref"]) if use_ref else None,
        **kw,
    )


def run_both(batch: dict[str, np.ndarray], **kw: Any) -> tuple[float, dict, float, dict]:
    """Evaluate the mx loss and the reference on the same batch and options."""
    use_ref = kw.pop("use_ref", False)
    ref_lp = batch["ref"] if use_ref else None
    loss, stats = mx_loss(batch, use_ref=use_ref, **kw)
    want, want_stats = ref_grpo_loss(
        batch["lp"], batch["old"], batch["adv"], batch["mask"], ref_logprobs=ref_lp, **kw
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
