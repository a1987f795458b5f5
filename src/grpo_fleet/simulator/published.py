"""Published Apple-silicon decode speeds and this project's measured learner throughput: the simulator's inputs.

Decode speeds are batch-1 tokens/s of 4-bit models from lablup/mlxcel's
benchmark tables (docs/benchmark_results/model_tests.md, "Decode Speed
Summary", mlxcel 0.2.1 on MLX 0.32-dev, 2026-06-15; mlxcel's decode is 96-99%
of mlx-lm's on the same hosts, docs/simulator.md, "Actor speeds"). Where the issue that asked for
this simulator quoted mlx-lm 0.31 itself (Qwen2.5-0.5B-Instruct 4-bit: 315 on
an M1 Ultra, 637 on an M5 Max; 7B: 111 and 124), those figures are used.
An actor decodes a group's G completions as one batch; on Apple GPUs a small
batch of a small model is bound by memory bandwidth, so it costs little more
per step than one sequence. `batch_speedup` (default 1: no gain, a lower
bound) is the user's to set from `grpo-fleet bench --only real_decode` on
their own Mac.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFigures:
    """One model size: parameters, LoRA trainable parameters and batch-1 decode tokens/s by Mac."""

    name: str
    params: float  # billions
    hidden: int
    layers: int
    mlp: int  # the MLP's inner width
    decode_tok_s: dict[str, float]
    source: str


MLXCEL = "lablup/mlxcel docs/benchmark_results/model_tests.md (mlxcel 0.2.1, 4-bit, batch 1)"
ISSUE = "mlx-lm 0.31 via lablup/mlxcel's tables, as quoted in issue K (4-bit, batch 1)"

MODELS: dict[str, ModelFigures] = {
    m.name: m for m in (
        ModelFigures("smollm2-135m", 0.135, 576, 30, 1536, {"m1-ultra": 374.92, "m5-max": 916.80}, MLXCEL + ", SmolLM-135M"),
        ModelFigures("qwen2.5-0.5b", 0.494, 896, 24, 4864, {"m1-ultra": 315.0, "m5-max": 637.0}, ISSUE),
        ModelFigures("1.6b", 1.6, 2048, 24, 5632, {"m1-ultra": 270.88, "m5-max": 424.38}, MLXCEL + ", StableLM-1.6B"),
        ModelFigures("3b", 3.0, 2048, 36, 11008, {"m1-ultra": 126.29, "m5-max": 232.99}, MLXCEL + ", SmolLM3-3B"),
        ModelFigures("qwen2.5-7b", 7.6, 3584, 28, 18944, {"m1-ultra": 111.0, "m5-max": 124.0}, ISSUE),
    )
}

# The learner's training throughput measured here (bench/RESULTS.md), in trained tokens (prompt + completion)
# per second on the 2-vCPU Linux VM: Qwen2.5-0.5B's shape with the flagship config (LoRA r16, grad
# checkpointing), 2 groups x 8 x 534 tokens in 427 s; SmolLM2-135M LoRA r8, `real_step`, 29.5 tok/s.
# Other sizes scale by parameter count (a step's FLOPs grow with it): an extrapolation, said so in the output.
MEASURED_LEARNER_TOK_S = {"smollm2-135m": 29.5, "qwen2.5-0.5b": 20.0}
LORA_RANK = 16
# The check's forward of one group at an older version (security.verify_logprobs: recomputed under the weights it
# claims) over that group's share of a one-rank step, measured alone on SmolLM2-135M, LoRA r8, 2 groups x 4, one
# OpenBLAS thread with this VM's SkylakeX kernels (`bench --only fleet_sim`, 2026-12-02: 0.55 after both runs; 0.62
# before, on the Prescott SSE3 kernels). A forward where the step runs pi_ref, a forward and a backward. The plan
# charges it for the drawn older groups only, times the share of their completions recomputed, split over the ranks.
LOGPROB_CHECK_SHARE = 0.55


def learner_tokens_per_second(model: ModelFigures) -> tuple[float, bool]:
    """(trained tokens/s of one learner rank on this VM, whether it is extrapolated by parameter count)."""
    if model.name in MEASURED_LEARNER_TOK_S:
        return MEASURED_LEARNER_TOK_S[model.name], False
    base = MODELS["qwen2.5-0.5b"]
    return MEASURED_LEARNER_TOK_S[base.name] * base.params / model.params, True


def lora_gradient_bytes(model: ModelFigures, rank: int = LORA_RANK) -> float:
    """fp32 gradient bytes a step all-reduces for LoRA on every linear of every block (mlx-lm's default keys):
    r x (in + out) for the four attention projections (taken as hidden x hidden: GQA's k and v are narrower,
    so this is an upper bound) and the MLP's three."""
    per_block = 4 * (2 * model.hidden) + 3 * (model.hidden + model.mlp)
    return 4.0 * model.layers * rank * per_block
