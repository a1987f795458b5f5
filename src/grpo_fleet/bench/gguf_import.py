"""Benchmark `gguf_import`: what importing a K-quant GGUF costs, on the zoo's Gemma 3 270M Q4_K_M.

Each import runs in a fresh process that reports its own peak resident memory, so
the figure is the import's and nothing else's. The baseline is the same process
with the same modules loaded that imports nothing; the goal is a peak no more
than twice the model the import writes (issue S: dequantizing is streamed a slice
of rows at a time, so the peak is near the interpreter plus one slice plus the
pages of the file it maps). Time is wall-clock seconds for `import_gguf`, the
whole of it: header, checks, tokenizer, dequantization, writing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.peak import measured
from grpo_fleet.models.zoo import fetch_gguf

MODEL = "gemma3-270m"
_PRELOAD = ["mlx.core", "mlx_lm.models.gemma3_text", "tokenizers", "gguf.quants"]


def _child(*args: str) -> dict:
    """import_gguf(source, out, dtype) measured in a fresh process; no arguments: the baseline, importing nothing."""
    kwargs = None if not args else {"source": args[0], "out_dir": args[1], "dtype": args[2]}
    return measured("grpo_fleet.models.gguf.importer:import_gguf", _PRELOAD, kwargs)


def _model_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def run(report: Report, scale: Scale) -> None:
    source = fetch_gguf(MODEL)
    idle = _child()
    dtypes = ["float32", "bfloat16"] if scale is not Scale.QUICK else ["float32"]
    with tempfile.TemporaryDirectory(prefix="grpo-bench-gguf-") as tmp:
        for dtype in dtypes:
            out = Path(tmp) / dtype
            measured = _child(str(source), str(out), dtype)
            size = _model_bytes(out)
            note = f"{source.name} ({source.stat().st_size / 1e6:.0f} MB) -> {dtype} directory of {size / 1e6:.0f} MB"
            report.add(Figure("gguf_import", f"import {MODEL} to {dtype}: wall time", measured["seconds"], "s", notes=note))
            report.add(Figure("gguf_import", f"import {MODEL} to {dtype}: peak resident memory", measured["peak_bytes"] / 1e6,
                              "MB", baseline=idle["peak_bytes"] / 1e6, baseline_name="interpreter + modules, no import",
                              notes=note))
            report.add(Figure("gguf_import", f"import {MODEL} to {dtype}: peak / final model size",
                              measured["peak_bytes"] / size, "x", goal="<= 2", notes=note))
            report.add(Figure("gguf_import", f"import {MODEL} to {dtype}: peak above the loaded interpreter / final size",
                              (measured["peak_bytes"] - measured["loaded_bytes"]) / size, "x", notes=note))
