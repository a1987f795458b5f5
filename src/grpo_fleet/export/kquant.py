"""K-quants (Q4_K_M) through llama.cpp's own quantizer: the `gguf` package has no K-quantizer, and llama.cpp's
chooses each tensor's type itself (Q4_K_M mixes Q4_K and Q6_K). Its `llama-quantize` binary on PATH is used, else
the same function in llama-cpp-python's library (`llama_model_quantize`)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from grpo_fleet.export.source import ExportError

K_QUANTS = {"q4_k_m": ("Q4_K_M", 15)}  # llama-quantize's name, llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
HOW_TO_GET = ("pip install 'grpo-fleet[llamacpp]' (llama-cpp-python, built from source), "
              "or put llama-quantize from llama.cpp (brew install llama.cpp) on PATH")


def quantizer() -> str:
    """Which quantizer would run: 'llama-quantize' (PATH), 'llama_cpp' (the Python binding), or '' (none)."""
    if shutil.which("llama-quantize"):
        return "llama-quantize"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ""
    return "llama_cpp"


def k_quantize(source: Path, out: Path, quant: str) -> Path:
    """Quantize the F16 GGUF `source` into `out` at the K-quant `quant`; a one-line error says how to get the tool."""
    name, ftype = K_QUANTS[quant]
    tool = quantizer()
    if not tool:
        raise ExportError(f"--gguf {quant} needs llama.cpp's quantizer, which is not here: {HOW_TO_GET}")
    if tool == "llama-quantize":
        done = subprocess.run([shutil.which("llama-quantize") or "llama-quantize", str(source), str(out), name],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise ExportError(f"llama-quantize failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise ExportError(f"llama.cpp's llama_model_quantize failed on {source} (status {status})")
    return out
