"""Benchmark `export_gguf`: `grpo-fleet export` of SmolLM2-135M-Instruct with LoRA adapters to a Q8_0 GGUF.

A run directory is made as a learner leaves one: the zoo's GGUF imported, rank-8 adapters on every layer with
lora_b drawn (as after some training), a checkpoint. The export then runs in a fresh process that reports its own
peak resident memory (the baseline: the same process with the same modules loaded, exporting nothing); time is
wall-clock seconds for `export_run`, the whole of it: loading, fusing, the mlx-lm directory, quantizing, the GGUF.

With llama-cpp-python installed, llama.cpp then reads the exported GGUFs and its greedy continuations are
compared with mlx-lm's on the fused model (export/llamacpp_check.py), at f16, Q8_0, Q4_0 and Q4_K_M.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.peak import measured
from grpo_fleet.config import LoraConfig
from grpo_fleet.models.loading import load_policy, save_checkpoint
from grpo_fleet.models.realshape import default_cache_dir
from grpo_fleet.models.zoo import import_source
from grpo_fleet.runtime.checkpoint_dirs import OPTIMIZER_FILE, STATE_FILE, point_latest

MODEL = "zoo:smollm2-135m-instruct"
# lora_b's spread: a weight change of about a tenth of SmolLM's own at lora.scale 20, as some training makes (0.01
# made it a tenth of the weights' size, and a model that no longer answers: its next tokens near-ties everywhere).
SPREAD = 0.001
_PRELOAD = ["mlx.core", "mlx_lm", "gguf.quants"]


def export_once(path: str, out: str, gguf: str) -> None:
    """The measured call (bench/peak.py passes keyword arguments as JSON)."""
    from grpo_fleet.export.run import ExportRequest, export_run

    export_run(ExportRequest(path=path, out=out, gguf=gguf))


def _child(*args: str) -> dict:
    """export_once(run_dir, out, gguf) in a fresh process; no arguments: the baseline, exporting nothing."""
    kwargs = None if not args else {"path": args[0], "out": args[1], "gguf": args[2]}
    return measured("grpo_fleet.bench.export_gguf:export_once", _PRELOAD, kwargs)


def trained_run(root: Path, model: str = MODEL, rank: int = 8, spread: float = SPREAD) -> Path:
    """A run directory of `model` (a GGUF model path, or an mlx-lm directory) whose latest checkpoint holds
    rank-`rank` adapters with lora_b drawn at `spread` (lora_a is mlx-lm's own initialisation)."""
    base = model if Path(model).is_dir() else str(import_source(model, default_cache_dir()))
    policy = load_policy(base, lora=LoraConfig(enabled=True, rank=rank))
    mx.random.seed(0)
    adapters = cast(list[tuple[str, mx.array]], tree_flatten(policy.model.trainable_parameters()))
    policy.model.load_weights([(n, spread * mx.random.normal(v.shape)) for n, v in adapters if n.endswith("lora_b")],
                              strict=False)
    checkpoints = root / "checkpoints"
    checkpoints.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model": {"path": model}, "generation": {"temperature": 0.7}}))

    def learner_files(staging: Path) -> None:  # what makes a checkpoint complete; export does not read them
        for name in (STATE_FILE, OPTIMIZER_FILE):
            (staging / name).write_bytes(b"-")

    path = save_checkpoint(policy, checkpoints / "step_000001", extra={"step": 1}, write_extra=learner_files)
    point_latest(checkpoints, path, {"step": 1})
    return root


def run(report: Report, scale: Scale) -> None:
    idle = _child()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-export-") as tmp:
        run_dir = trained_run(Path(tmp) / "run")
        measured = _child(str(run_dir), str(Path(tmp) / "q8_0"), "q8_0")
        gguf = next((Path(tmp) / "q8_0").glob("*.gguf"))
        size = gguf.stat().st_size / 1e6
        note = f"SmolLM2-135M-Instruct + rank-8 LoRA -> mlx-lm directory (float32) and {size:.0f} MB Q8_0 GGUF"
        report.add(Figure("export_gguf", "export SmolLM2-135M + LoRA to Q8_0: wall time", measured["seconds"], "s",
                          notes=note))
        report.add(Figure("export_gguf", "export SmolLM2-135M + LoRA to Q8_0: peak resident memory",
                          measured["peak_bytes"] / 1e6, "MB", baseline=idle["peak_bytes"] / 1e6,
                          baseline_name="interpreter + modules, no export", notes=note))
        if scale is Scale.FULL:  # four exports and 4 x 512 greedy tokens on each side: minutes
            _agreement(report, run_dir, Path(tmp))


def _agreement(report: Report, run_dir: Path, tmp: Path) -> None:
    """llama.cpp's greedy continuations on each exported type against mlx-lm's on the fused model (32 x 16)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("[export_gguf] llama-cpp-python is not installed: no greedy agreement rows", flush=True)
        return
    from mlx_lm import load

    from grpo_fleet.export.llamacpp_check import compare
    from grpo_fleet.export.run import ExportRequest, export_run
    from grpo_fleet.models.gguf.importer import import_gguf

    for quant in ("f16", "q8_0", "q4_0", "q4_k_m"):
        result = export_run(ExportRequest(path=str(run_dir), out=str(tmp / quant), gguf=quant))
        assert result.gguf is not None
        fused, tokenizer = load(str(result.mlx_dir))[:2]
        same = load(str(import_gguf(result.gguf, tmp / f"same-{quant}")))[0]  # the GGUF's own weights, in mlx-lm
        for against, model in (("the fp32 fused model", fused), ("the GGUF's own weights", same)):
            agreement = compare(result.gguf, model, tokenizer)
            report.add(Figure("export_gguf", f"llama.cpp greedy = mlx-lm on {against}, {quant}: identical continuations",
                              agreement.identical, f"of {agreement.prompts}", notes=agreement.describe()))
        if quant == "q8_0":
            identical, shared = q8_0_against_its_f16(result.gguf, tmp, tokenizer)
            report.add(Figure("export_gguf", "llama.cpp greedy on Q8_0 = llama.cpp on an F16 file of the same weights: "
                              "identical continuations", identical, "of 32", notes=f"{shared}/512 tokens before the "
                              "first difference; only llama.cpp's Q8_0 arithmetic (activations rounded to 8 bits) differs"))


def q8_0_against_its_f16(q8_0: Path, tmp: Path, tokenizer: Any, prompts: int = 32, tokens: int = 16) -> tuple[int, int]:
    """llama.cpp on a Q8_0 GGUF against llama.cpp on an F16 GGUF of the same weights (the Q8_0 blocks dequantized,
    which f16 holds to 2^-11): (identical continuations, tokens before the first difference). The weights being the
    same, what differs is llama.cpp's own Q8_0 arithmetic, whose products round the activations to 8 bits."""
    from functools import partial

    from grpo_fleet.export.gguf_writer import header_from_gguf, write_gguf
    from grpo_fleet.export.llamacpp_check import agreement, chat_prompt, llamacpp_greedy, open_gguf, prompt_texts
    from grpo_fleet.models.gguf.importer import import_gguf

    weights = mx.load(str(import_gguf(q8_0, tmp / "q8_0-weights") / "model.safetensors"))
    f16 = write_gguf(cast(dict[str, mx.array], weights), header_from_gguf(q8_0), tmp / "q8_0-weights-F16.gguf", "f16")
    ids = [list(tokenizer.encode(chat_prompt(tokenizer, text), add_special_tokens=False)) for text in prompt_texts(prompts)]
    quantized, plain = open_gguf(q8_0), open_gguf(f16)
    try:
        return agreement(partial(llamacpp_greedy, quantized, count=tokens), partial(llamacpp_greedy, plain, count=tokens),
                         ids)
    finally:
        quantized.close()
        plain.close()
