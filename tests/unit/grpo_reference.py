"""Float64 NumPy reference for the GRPO objective, written from the formulas alone.

Deliberately independent of `grpo_fleet.learner.step.grpo`: loops and plain NumPy,
so that a shared mistake is unlikely.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# Log importance ratios are clamped to +-20 before exp (exp(20) = 4.9e8): beyond
# that a ratio only overflows; the same bound as verl's.
MAX_LOG_RATIO = 20.0


def ref_group_advantages(
    rewards: np.ndarray, group_size: int, scale_by_std: bool = True, eps: float = 1e-4
) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    for start in range(0, len(r), group_size):
        g = r[start : start + group_size]
        if np.all(g == g[0]):
            continue  # zero-variance group: exactly 0
        adv = g - g.mean()
        if scale_by_std:
            adv = adv / (g.std(ddof=0) + eps)
        out[start : start + group_size] = adv
    return out


def ref_group_is_informative(rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return np.array([len(set(row.tolist())) > 1 for row in r], dtype=bool)


def ref_token_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    b, t, _ = x.shape
    out = np.empty((b, t))
    for i in range(b):
        for j in range(t):
            row = x[i, j]
            top = row.max()
            lse = top + np.log(np.exp(row - top).sum())
            out[i, j] = row[targets[i, j]] - lse
    return out


def ref_kl_k3(logprobs: np.ndarray, ref_logprobs: np.ndarray) -> np.ndarray:
    d = np.asarray(ref_logprobs, np.float64) - np.asarray(logprobs, np.float64)
    return np.exp(d) - d - 1.0


def ref_overlong_penalty(lengths: np.ndarray, max_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO: 0 up to L_max - L_cache tokens, then (L_max - L_cache - |y|) / L_cache, never below -1; times factor."""
    out = np.zeros(len(lengths))
    for i, length in enumerate(lengths):
        expected = max_tokens - buffer
        if length > expected:
            out[i] = factor * max((expected - length) / buffer, -1.0)
    return out


def ref_behaviour_weights(
    proximal: np.ndarray, behaviour: np.ndarray, mask: np.ndarray, cap: float, mode: str, level: str
) -> tuple[np.ndarray, np.ndarray]:
    """(weight, capped) per token: w = pi_prox / pi_behav per token or as each row's geometric mean, then TIS / MIS."""
    prox, behav, m = (np.asarray(a, np.float64) for a in (proximal, behaviour, mask))
    b, t = prox.shape
    weight, capped = np.ones((b, t)), np.zeros((b, t))
    for i in range(b):
        sel = m[i] > 0
        if not sel.any():
            continue
        logs = np.clip(prox[i, sel] - behav[i, sel], -MAX_LOG_RATIO, MAX_LOG_RATIO)
        if level == "sequence":
            logs = np.full(sel.sum(), np.clip(np.mean(prox[i, sel] - behav[i, sel]), -MAX_LOG_RATIO, MAX_LOG_RATIO))
        w = np.exp(logs)
        over = w > cap
        weight[i, sel] = np.minimum(w, cap) if mode == "truncate" else np.where(over, 0.0, w)
        capped[i, sel] = over
    return weight, capped


def ref_offpolicy_stats(
    proximal: np.ndarray, behaviour: np.ndarray, mask: np.ndarray, cap: Optional[float] = None,
    mode: str = "truncate", level: str = "token",
) -> dict[str, float]:
    m = np.asarray(mask, np.float64) > 0
    gaps = np.abs(np.asarray(proximal, np.float64) - np.asarray(behaviour, np.float64))[m]
    capped = 0.0
    if cap is not None:
        capped = float(ref_behaviour_weights(proximal, behaviour, mask, cap, mode, level)[1][m].mean())
    return {"offpolicy_gap_mean": float(gaps.mean()), "offpolicy_gap_max": float(gaps.max()), "is_capped_fraction": capped}


def ref_grpo_loss(
    logprobs: np.ndarray,
    old_logprobs: np.ndarray,
    advantages: np.ndarray,
    mask: np.ndarray,
    ref_logprobs: Optional[np.ndarray] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    loss_type: str = "grpo",
    max_tokens: Optional[int] = None,
    proximal_logprobs: Optional[np.ndarray] = None,
    is_cap: float = 2.0,
    is_mode: str = "truncate",
    is_level: str = "token",
    dual_clip: Optional[float] = None,
) -> tuple[float, dict[str, float]]:
    """Return (loss, stats) as Python floats.

    Coupled when `proximal_logprobs` is None (ratio against `old_logprobs`, the
    behaviour policy); decoupled otherwise (ratio against the proximal policy, the
    surrogate times the truncated / masked pi_prox / pi_behav weight).
    """
    lp = np.asarray(logprobs, np.float64)
    old = np.asarray(old_logprobs, np.float64)
    anchor = old if proximal_logprobs is None else np.asarray(proximal_logprobs, np.float64)
    adv = np.asarray(advantages, np.float64)
    m = np.asarray(mask, np.float64)
    eh = epsilon_low if epsilon_high is None else epsilon_high
    b, t = lp.shape

    ratio = np.ones((b, t))
    for i in range(b):
        sel = m[i] > 0
        if loss_type == "gspo":
            n = m[i].sum()
            seq = np.exp(np.clip(((lp[i] - anchor[i]) * m[i]).sum() / n, -MAX_LOG_RATIO, MAX_LOG_RATIO)) if n > 0 else 1.0
            ratio[i, :] = seq
        else:
            ratio[i, sel] = np.exp(np.clip(lp[i, sel] - anchor[i, sel], -MAX_LOG_RATIO, MAX_LOG_RATIO))

    surr = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            r, a = ratio[i, j], adv[i]
            value = min(r * a, min(max(r, 1 - epsilon_low), 1 + eh) * a)
            if dual_clip is not None and a < 0:
                value = max(value, dual_clip * a)
            surr[i, j] = value
    if proximal_logprobs is not None:
        weight, _ = ref_behaviour_weights(anchor, old, m, is_cap, is_mode, is_level)
        surr = weight * surr
    k3 = np.zeros((b, t))
    if ref_logprobs is not None:
        ref = np.asarray(ref_logprobs, np.float64)
        on = m > 0
        k3[on] = ref_kl_k3(lp[on], ref[on])
    obj = surr - beta * k3 if (ref_logprobs is not None and beta > 0) else surr

    def agg(x: np.ndarray) -> float:
        if loss_type in ("grpo", "gspo"):
            rows = [(x[i] * m[i]).sum() / max(m[i].sum(), 1.0) for i in range(b)]
            return float(np.mean(rows))
        if loss_type == "dapo":
            return float((x * m).sum() / m.sum())
        if loss_type == "dr_grpo":
            return float((x * m).sum() / (b * max_tokens))
        raise ValueError(loss_type)

    total = m.sum()
    outside = ((ratio < 1 - epsilon_low) | (ratio > 1 + eh)).astype(np.float64)
    stats = {
        "clip_fraction": float((outside * m).sum() / total),
        "kl": float((k3 * m).sum() / total),
        "policy_objective": agg(surr),
        "ratio_mean": float((ratio * m).sum() / total),
    }
    return -agg(obj), stats
