"""The line a finished run ends with: the `grpo-fleet export` command that takes its checkpoint to a chat app."""

from __future__ import annotations

import shlex
from pathlib import Path


def export_hint(run_dir: str | Path, from_gguf: bool) -> str:
    """The export command for `run_dir`; `from_gguf`: the model came from a GGUF, so a GGUF (llama.cpp, LM Studio,
    Ollama) is sure to be written, and the Ollama step is offered."""
    run = str(run_dir)
    command = f"grpo-fleet export {shlex.quote(run)} --out {shlex.quote(str(Path(run) / 'export'))}"
    if from_gguf:
        return (f"next, back to your app: {command} --ollama NAME  (an mlx-lm directory and a Q8_0 GGUF for "
                "llama.cpp, LM Studio and Ollama; docs/export.md)")
    return (f"next, fuse the adapters into an mlx-lm directory (mlx_lm.generate, LM Studio), and a Q8_0 GGUF where "
            f"llama.cpp runs the model's family: {command}  (docs/export.md)")
