"""The logprob check's honest bound follows the actor's and the learner's dtypes (learner/step/gap_bounds.py)."""

from __future__ import annotations

import mlx.nn as nn
import pytest

from grpo_fleet.learner.step.gap_bounds import actor_dtype, compute_dtype, logprob_gap_bound

# bench/RESULTS.md, "The logprob check's noise floor": (actor dtype, mean per-token gap, largest token) of honest
# actors against the float32 learner, on the tiny demo model and at Qwen2.5-0.5B's shape.
# SmolLM2-135M (30 blocks, pretrained) measured with bench/logprob_gap.py's gaps() for the float32 pair.
MEASURED_FLOORS = [("float32", 7.4e-8, 1e-4), ("float32", 7.6e-7, 1e-4), ("float32", 3.2e-6, 1.5e-5),
                   ("bfloat16", 0.00098, 0.0030), ("bfloat16", 0.0043, 0.021), ("bfloat16", 0.045, 0.33)]
# bench liar_lags on the demo model: a float32 actor serving weights 1-2 versions stale, claiming the newest.
STALE_WEIGHT_GAPS = [0.0033, 0.02, 0.07]  # the smallest group gap measured, the range


@pytest.mark.parametrize(("dtype", "mean", "largest"), MEASURED_FLOORS)
def test_no_honest_floor_measured_reaches_its_bound(dtype: str, mean: float, largest: float) -> None:
    bound = logprob_gap_bound(dtype, "float32")
    assert mean * 3 < bound, "a margin of 3x at least over the mean floor"
    if dtype == "float32":
        assert largest * 5 < bound, "a float32 group fails only far beyond the worst honest token"


@pytest.mark.parametrize("gap", STALE_WEIGHT_GAPS)
def test_stale_weights_are_beyond_the_float32_bound(gap: float) -> None:
    assert gap > logprob_gap_bound("float32", "float32")


def test_half_precision_on_either_side_or_an_unknown_actor_gets_the_loose_bound() -> None:
    loose = logprob_gap_bound("bfloat16", "float32")
    assert logprob_gap_bound("float16", "float32") == loose
    assert logprob_gap_bound("float32", "bfloat16") == loose
    assert logprob_gap_bound(None, "float32") == loose
    assert logprob_gap_bound("float32", "float32") < loose


def test_an_actor_samples_in_the_requested_dtype_else_float32_on_the_cpu() -> None:
    assert actor_dtype("bfloat16", "Device(cpu, 0)") == "bfloat16"
    assert actor_dtype(None, "Device(cpu, 0)") == "float32"
    assert actor_dtype(None, "Device(gpu, 0)") is None, "a Metal actor keeps the checkpoint's dtype"


def test_the_learners_dtype_is_its_least_precise_floating_parameter() -> None:
    import mlx.core as mx

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert compute_dtype(model) == "float32"
    model.layers[1].set_dtype(mx.bfloat16)
    assert compute_dtype(model) == "bfloat16"
