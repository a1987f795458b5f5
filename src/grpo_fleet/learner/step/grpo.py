"""The GRPO objective as pure functions over `mx.array`s.

Everything here is side-effect free: arrays in, arrays out, so the learner can
wrap `grpo_loss` in `nn.value_and_grad` and the tests can compare each piece
against a float64 NumPy reference. Its neighbours are pure in the same way:
advantages.py (rewards to advantages) and offpolicy.py (the step's off-policy stats).

Conventions: token tensors are `[B, T]` (one row per completion, `T` the padded
completion length), `mask` marks the completion tokens that count, and
advantages are one scalar per completion, `[B]`.

Three policies appear: pi_behav, the actor's snapshot that sampled the tokens
(`old_logprobs`, reported by the actor); pi_prox, the learner's policy before
this step's update (`proximal_logprobs`); pi_theta, the weights being trained.
The coupled objective clips pi_theta / pi_behav; the decoupled one (AReaL) clips
pi_theta / pi_prox and weights by pi_prox / pi_behav.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence")

Axis = Optional[Union[int, tuple[int, ...]]]


def as_float(x: mx.array) -> mx.array:
    """Cast to float32 unless already a floating type of at least 32 bits."""
    if x.dtype in (mx.float32, mx.float64):
        return x
    return x.astype(mx.float32)


def kl_k3(logprobs: mx.array, ref_logprobs: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(pi || pi_ref): `exp(d) - d - 1`, `d = ref - lp`.

    Unbiased for samples from pi and always >= 0, unlike the plain log ratio.
    """
    d = ref_logprobs - logprobs
    return mx.exp(d) - d - 1.0


def masked_mean(x: mx.array, mask: mx.array, axis: Axis = None) -> mx.array:
    """Mean of `x` over the positions where `mask` is set; 0 where nothing is.

    The denominator is clamped to 1 so an empty selection gives 0, not NaN.
    """
    m = as_float(mask)
    return mx.sum(x * m, axis=axis) / mx.maximum(mx.sum(m, axis=axis), 1.0)


def _token_mean(x: mx.array, m: mx.array, total_tokens: Optional[mx.array]) -> mx.array:
    """Mean over masked tokens; with `total_tokens`, this slice's share of the batch-wide mean."""
    if total_tokens is None:
        return masked_mean(x, m)
    return mx.sum(x * m) / mx.maximum(total_tokens, 1.0)


def _aggregate(
    x: mx.array,
    m: mx.array,
    loss_type: str,
    max_tokens: Optional[int],
    total_tokens: Optional[mx.array] = None,
    total_sequences: Optional[mx.array] = None,
) -> mx.array:
    """Reduce per-token values `[B, T]` to a scalar the way `loss_type` prescribes.

    With the batch totals given, the result is this micro-batch's additive share
    of the whole batch's value, so summing the shares over micro-batches gives
    exactly the one-batch loss (a sequence is never split across micro-batches).
    """
    sequences = x.shape[0] if total_sequences is None else total_sequences
    if loss_type in ("grpo", "gspo"):
        # Each completion weighs the same regardless of its length.
        return mx.sum(masked_mean(x, m, axis=1)) / sequences
    if loss_type == "dapo":
        # Each token weighs the same across the batch.
        return _token_mean(x, m, total_tokens)
    # dr_grpo: a constant denominator removes the length bias entirely.
    assert max_tokens is not None  # checked by the caller (_check_loss_args)
    return mx.sum(x * m) / (sequences * max_tokens)


def _check_loss_args(
    logprobs: mx.array,
    advantages: mx.array,
    ref_logprobs: Optional[mx.array],
    beta: float,
    loss_type: str,
    max_tokens: Optional[int],
    dual_clip: Optional[float],
    same_shape: dict[str, Optional[mx.array]],
) -> None:
    """Raise ValueError for inconsistent shapes or option combinations."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type == "dr_grpo" and (max_tokens is None or max_tokens < 1):
        raise ValueError("loss_type 'dr_grpo' needs a positive max_tokens")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {logprobs.shape}")
    for name, arr in same_shape.items():
        if arr is not None and arr.shape != logprobs.shape:
            raise ValueError(f"{name} shape {arr.shape} != logprobs shape {logprobs.shape}")
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(f"advantages shape {advantages.shape} != ({logprobs.shape[0]},)")


# Log-ratios are clamped to +-20 before exp (verl does the same): a ratio past
# e^20 = 4.9e8 carries no signal, and exp of a larger one overflows float32, so
# one token with a stale or hostile old logprob could make the loss inf.
MAX_LOG_RATIO = 20.0


def _bounded_exp(log_ratio: mx.array) -> mx.array:
    return mx.exp(mx.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _per_sequence(log_ratio: mx.array, m: mx.array) -> mx.array:
    """Each row's mean log-ratio over its own tokens, broadcast back to `[B, T]` (a geometric mean once exp'd)."""
    return mx.broadcast_to(masked_mean(log_ratio, m, axis=1)[:, None], log_ratio.shape)


def _ratio(log_ratio: mx.array, m: mx.array, loss_type: str) -> mx.array:
    """Importance ratio per token: token-level, or GSPO's broadcast sequence ratio."""
    if loss_type == "gspo":
        return _bounded_exp(_per_sequence(log_ratio, m))
    return _bounded_exp(log_ratio)


@dataclass(frozen=True)
class BehaviourCorrection:
    """How the decoupled objective turns w = pi_prox / pi_behav into a token's weight.

    `mode` "truncate" (TIS) weighs by min(w, cap); "mask" (MIS) by w up to `cap`
    and 0 beyond. `level` "token" takes w per token; "sequence" one w per
    completion, the geometric mean exp(mean_t log w_t) of its tokens. The product
    (verl's `rollout_is = sequence`, TRL's `sequence_*` modes, prime-rl's sequence
    ratio) grows with length: a 0.01-nat mismatch per token is e^5 over 500
    tokens, so a cap would cut nearly every long completion. The geometric mean
    (verl's `geometric` rejection, GSPO's ratio) does not depend on length.
    """

    cap: float = 2.0
    mode: str = "truncate"
    level: str = "token"

    def __post_init__(self) -> None:
        if self.cap < 1.0:
            raise ValueError(f"behaviour weight cap must be >= 1 (w = 1 when pi_prox = pi_behav), got {self.cap}")
        if self.mode not in IS_MODES:
            raise ValueError(f"unknown behaviour weight mode {self.mode!r}; expected one of {IS_MODES}")
        if self.level not in IS_LEVELS:
            raise ValueError(f"unknown behaviour weight level {self.level!r}; expected one of {IS_LEVELS}")


def behaviour_weights(
    proximal_logprobs: mx.array, behaviour_logprobs: mx.array, mask: mx.array, correction: BehaviourCorrection
) -> tuple[mx.array, mx.array]:
    """Detached weights `[B, T]` from pi_prox / pi_behav, and 1.0 where the cap truncated or masked them.

    Off-mask positions get w = 1 and are never capped. A NaN logprob stays NaN
    (so the step is skipped as non-finite, never silently weighted 0).
    """
    m = mask.astype(mx.float32)
    on = m != 0
    log_w = mx.where(on, as_float(proximal_logprobs) - as_float(behaviour_logprobs), 0.0)
    if correction.level == "sequence":
        log_w = mx.where(on, _per_sequence(log_w, m), 0.0)
    w = _bounded_exp(log_w)
    capped = w > correction.cap
    kept = mx.minimum(w, correction.cap) if correction.mode == "truncate" else mx.where(capped, 0.0, w)
    return mx.stop_gradient(kept), capped.astype(mx.float32)


def _clipped_surrogate(
    ratio: mx.array, adv: mx.array, epsilons: tuple[float, float], dual_clip: Optional[float]
) -> mx.array:
    """PPO's pessimistic `min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`.

    With dual-clip c (Ye et al. 2020, verl's clip_ratio_c, AReaL's c_clip) a
    negative-advantage token's objective is also kept >= c A: the min alone is
    unbounded below as r grows, and one such token could outweigh the batch.
    """
    clipped = mx.clip(ratio, 1.0 - epsilons[0], 1.0 + epsilons[1])
    surrogate = mx.minimum(ratio * adv, clipped * adv)
    if dual_clip is None:
        return surrogate
    return mx.where(adv < 0, mx.maximum(surrogate, dual_clip * adv), surrogate)


def grpo_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    *,
    ref_logprobs: Optional[mx.array] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    loss_type: str = "grpo",
    max_tokens: Optional[int] = None,
    total_tokens: Optional[mx.array] = None,
    total_sequences: Optional[mx.array] = None,
    proximal_logprobs: Optional[mx.array] = None,
    correction: BehaviourCorrection = BehaviourCorrection(),
    dual_clip: Optional[float] = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Clipped-surrogate GRPO loss (to minimise) and detached scalar stats.

    `old_logprobs` are pi_behav's. Per token, with `s(r) = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`
    (and `>= dual_clip * A` for A < 0 when set):
    - coupled (`proximal_logprobs` None): `o = s(pi_theta / pi_behav) - beta * k3`;
    - decoupled: `o = w * s(pi_theta / pi_prox) - beta * k3`, with `w` the detached
      `behaviour_weights(pi_prox, pi_behav)` under `correction`. When pi_prox =
      pi_behav, w = 1 and this is exactly the coupled loss.
    `o` is aggregated per `loss_type` ("grpo", "dapo", "dr_grpo", "gspo") and negated.
    A weight of 0 (MIS) removes a token's surrogate but not its place in the
    normaliser, which is fixed before any forward (so micro-batch shares stay exact).

    The k3 term estimates KL(pi_theta || pi_ref) against the reference policy
    (the base model, or a frozen copy), not against pi_behav or pi_prox. It is not
    multiplied by w (nor masked by MIS): it is a regulariser pulling pi_theta
    towards pi_ref at the sampled tokens, not an estimate we need unbiased for
    pi_theta's own samples; weighting it would switch it off exactly where the
    policy has moved most, and make beta mean something different per objective.
    TRL and verl leave it unweighted too.

    Stats: `clip_fraction`, `kl`, `policy_objective`, `ratio_mean` (of pi_theta /
    pi_behav coupled, pi_theta / pi_prox decoupled: 1 at ppo_epochs = 1).

    `total_tokens` / `total_sequences` are the whole batch's completion-token and
    sequence counts when these rows are one micro-batch of it: the loss and every
    stat are then this micro-batch's share, and the shares sum to the batch value.
    """
    shapes = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
              "proximal_logprobs": proximal_logprobs}
    _check_loss_args(logprobs, advantages, ref_logprobs, beta, loss_type, max_tokens, dual_clip, shapes)
    epsilons = (epsilon_low, epsilon_low if epsilon_high is None else epsilon_high)
    m = mask.astype(mx.float32)
    on = m != 0
    lp = as_float(logprobs)
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    # Padding positions may hold garbage log-probs; zero their log ratio so exp()
    # cannot overflow into inf * 0 = NaN (in the value or the gradient).
    ratio = _ratio(mx.where(on, lp - as_float(anchor), 0.0), m, loss_type)
    surrogate = _clipped_surrogate(ratio, as_float(advantages)[:, None], epsilons, dual_clip)
    if proximal_logprobs is not None:
        surrogate = behaviour_weights(proximal_logprobs, old_logprobs, m, correction)[0] * surrogate

    objective = surrogate
    k3 = None
    if ref_logprobs is not None:
        # Same guard: masked positions compare 0 with 0 and give k3 = 0.
        k3 = kl_k3(mx.where(on, lp, 0.0), mx.where(on, as_float(ref_logprobs), 0.0))
        if beta > 0:
            objective = surrogate - beta * k3
    totals = (total_tokens, total_sequences)
    loss = -_aggregate(objective, m, loss_type, max_tokens, *totals)
    stats = _loss_stats(ratio, surrogate, k3, m, epsilons, loss_type, max_tokens, totals)
    return loss, stats


def _loss_stats(
    ratio: mx.array,
    surrogate: mx.array,
    k3: Optional[mx.array],
    m: mx.array,
    epsilons: tuple[float, float],
    loss_type: str,
    max_tokens: Optional[int],
    totals: tuple[Optional[mx.array], Optional[mx.array]],
) -> dict[str, mx.array]:
    """Monitoring scalars, detached so that returning them never changes gradients."""
    ratio = mx.stop_gradient(ratio)
    surrogate = mx.stop_gradient(surrogate)
    tokens = totals[0]
    outside = (ratio < 1.0 - epsilons[0]) | (ratio > 1.0 + epsilons[1])
    kl = mx.array(0.0) if k3 is None else _token_mean(mx.stop_gradient(k3), m, tokens)
    return {
        "clip_fraction": _token_mean(outside.astype(mx.float32), m, tokens),
        "kl": kl,
        "policy_objective": _aggregate(surrogate, m, loss_type, max_tokens, *totals),
        "ratio_mean": _token_mean(ratio, m, tokens),
    }
