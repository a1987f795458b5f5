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

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.zoo import fetch_gguf

MODEL = "gemma3-270m"
# The child: load what an import loads, note the resident peak, import (or not), report.
_CHILD = r"""
import json, resource, sys, time
from grpo_fleet.gguf import import_gguf
import mlx.core, mlx_lm.models.gemma3_text, tokenizers, gguf.quants
scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
start = time.perf_counter()
if sys.argv[1] != "-":
    import_gguf(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - start, "loaded_bytes": before,
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}))
"""


def _child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=1800, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _model_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def run(report: Report, scale: Scale) -> None:
    source = fetch_gguf(MODEL)
    idle = _child("-")
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
