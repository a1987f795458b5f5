"""A checkpoint's adapters fused into its base model with mlx-lm's own LoRA `fuse`, and the result written as an
mlx-lm directory (safetensors, config.json, tokenizer files with the chat template) that `mlx_lm.load` and LM
Studio's MLX engine read."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.export.source import ExportSource


@dataclass
class Fused:
    """The fused model (adapters folded into the weights), its tokenizer wrapper and config.json."""

    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]

    def weights(self) -> dict[str, mx.array]:
        """Every parameter by its Hugging Face name (the names mlx-lm's models use)."""
        return dict(tree_flatten(self.model.parameters()))


def fuse_checkpoint(source: ExportSource) -> Fused:
    """Load the base with the checkpoint's adapters and fuse them (mlx_lm fuse's steps); a full fine-tune checkpoint
    is a model directory already and is loaded as it is."""
    if not source.has_adapters:
        return Fused(*_load(str(source.checkpoint), None))
    model, tokenizer, config = _load(source.base_model, str(source.checkpoint))
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    return Fused(model, tokenizer, config)


def _load(path: str, adapter_path: Optional[str]) -> tuple[nn.Module, Any, dict[str, Any]]:
    """mlx_lm.load with its config (its declared result is a 2- or 3-tuple by flag)."""
    from mlx_lm.utils import load

    loaded = load(path, adapter_path=adapter_path, return_config=True)
    return loaded[0], loaded[1], cast(dict[str, Any], loaded[2])  # type: ignore[misc]


def write_mlx_dir(fused: Fused, source: ExportSource, out: Path) -> Path:
    """The fused model as an mlx-lm directory at `out` (replaced whole if it is there)."""
    from mlx_lm.utils import save

    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    base = source.checkpoint if not source.has_adapters else Path(source.base_model)
    save(staging, base, fused.model, fused.tokenizer, fused.config, donate_model=False)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
