"""`grpo-fleet export`: a run's checkpoint back to the apps people chat in.

read the source (export/source.py) -> the GGUF's header: the source GGUF's metadata for a model imported from one,
else one built from the model's mlx-lm directory (export/hf_header.py) -> fuse the adapters with mlx-lm
(export/fuse.py) -> write the mlx-lm directory -> write the GGUF (export/gguf_writer.py; K-quants through llama.cpp,
export/kquant.py) -> for `--ollama NAME`, a Modelfile beside it and the `ollama create` command (models/app_stores.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from grpo_fleet.export.fuse import Fused, fuse_checkpoint, write_mlx_dir
from grpo_fleet.export.gguf_writer import WRITTEN, Header, header_from_gguf, write_gguf
from grpo_fleet.export.hf_header import header_from_hf, model_directory
from grpo_fleet.export.kquant import HOW_TO_GET, k_quantize, quantizer
from grpo_fleet.export.names import DEFAULT_GGUF, GGUF_TYPES, K_QUANT_TYPES
from grpo_fleet.export.source import ExportError, ExportSource, read_source
from grpo_fleet.models.app_stores import write_modelfile


@dataclass(frozen=True)
class ExportRequest:
    """What `grpo-fleet export` was asked for."""

    path: str  # a run directory or a checkpoint directory
    out: str
    step: Optional[int] = None
    gguf: Optional[str] = None  # one of GGUF_TYPES; None: DEFAULT_GGUF when the model can be written as one
    ollama: Optional[str] = None  # the name for `ollama create`


@dataclass(frozen=True)
class ExportResult:
    mlx_dir: Path
    gguf: Optional[Path]
    modelfile: Optional[Path]
    ollama_command: Optional[str]
    seconds: float
    note: str = ""  # why no GGUF was written, when none was asked for and the model cannot be written as one

    def describe(self) -> str:
        lines = [f"mlx-lm directory: {self.mlx_dir}  (mlx_lm.generate --model {self.mlx_dir}; LM Studio's MLX engine)"]
        if self.gguf is not None:
            lines.append(f"GGUF: {self.gguf}  (llama.cpp, LM Studio, Ollama)")
        if self.note:
            lines.append(self.note)
        if self.ollama_command is not None:
            lines.append(f"Ollama: {self.ollama_command}")
        lines.append(f"exported in {self.seconds:.1f} s")
        return "\n".join(lines)


def export_run(request: ExportRequest) -> ExportResult:
    """Do the export; every refusal is an ExportError with a one-line reason, raised before anything is written."""
    started = time.perf_counter()
    quant = _check(request)
    source = read_source(request.path, request.step)
    header, why_not = _header(source, required=quant is not None)
    if quant is None and header is not None:
        quant = DEFAULT_GGUF
    if request.ollama and header is None:
        raise ExportError(f"--ollama needs a GGUF, and this run's model {source.model_path!r} cannot be one: {why_not}")
    out = Path(request.out)
    out.mkdir(parents=True, exist_ok=True)
    fused = fuse_checkpoint(source)
    mlx_dir = write_mlx_dir(fused, source, out / "mlx")
    gguf = None if quant is None or header is None else _write_gguf(fused, header, source, out, quant)
    modelfile, command = None, None
    if request.ollama and gguf is not None:
        modelfile, command = write_modelfile(gguf, request.ollama, _chat_template(fused), _stops(fused),
                                             source.temperature, source.top_p)
    note = "" if gguf is not None else f"no GGUF: {why_not}"
    return ExportResult(mlx_dir, gguf, modelfile, command, time.perf_counter() - started, note)


def _check(request: ExportRequest) -> Optional[str]:
    quant = None if request.gguf is None else request.gguf.lower()
    if quant is not None and quant not in GGUF_TYPES:
        raise ExportError(f"--gguf {request.gguf} is not one of {', '.join(GGUF_TYPES)}")
    if quant in K_QUANT_TYPES and not quantizer():
        raise ExportError(f"--gguf {quant} needs llama.cpp's quantizer, which is not here: {HOW_TO_GET}")
    return quant


def _header(source: ExportSource, required: bool) -> tuple[Optional[Header], str]:
    """The GGUF's header (the source GGUF's, else one from the mlx-lm directory) and, when there is none, why: a
    refusal when a GGUF was asked for, a note when it was not."""
    try:
        if source.gguf is not None:
            return header_from_gguf(source.gguf), ""
        model_dir = source.checkpoint if not source.has_adapters else model_directory(source.base_model)
        return header_from_hf(model_dir), ""
    except ExportError as exc:
        if required:
            raise ExportError(f"no GGUF can be written for {source.model_path!r}: {exc}") from None
        return None, str(exc)


def _write_gguf(fused: Fused, header: Header, source: ExportSource, out: Path, quant: str) -> Path:
    step = f"step{source.step}" if source.step is not None else "model"
    target = out / f"{step}-{quant.upper()}.gguf"
    if quant in WRITTEN:
        return write_gguf(fused.weights(), header, target, quant)
    f16 = out / f".{step}-F16.for-{quant}.gguf"
    try:
        write_gguf(fused.weights(), header, f16, "f16")
        return k_quantize(f16, target, quant)
    finally:
        f16.unlink(missing_ok=True)


def _chat_template(fused: Fused) -> Optional[str]:
    template = getattr(fused.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def _stops(fused: Fused) -> list[str]:
    """The text of every token generation stops at (mlx-lm's eos_token_ids: the file's EOS and turn ends)."""
    ids = sorted(getattr(fused.tokenizer, "eos_token_ids", None) or [])
    return [str(fused.tokenizer.convert_ids_to_tokens(i)) for i in ids]
