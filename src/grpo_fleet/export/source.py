"""What an export starts from: a checkpoint (a run directory's latest, its step N, or one named directly), the base
model it was trained from, the GGUF that base was imported from (if any), and the run's sampling settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.runtime.checkpoint_dirs import checkpoint_key, checkpoints, latest_checkpoint

RUN_CONFIG = "config.json"  # RUN_DIR/config.json, the run's resolved config
CHECKPOINT_META = "grpo_fleet.json"  # models/loading.py: save_checkpoint writes base_model, step
IMPORT_MARKER = "gguf_source.json"  # models/gguf/importer.py: the file an imported directory came from, and its digest


class ExportError(ValueError):
    """An export that cannot be done, with the reason in one line."""


@dataclass(frozen=True)
class ExportSource:
    """The checkpoint to export and what it needs: its base model directory, the GGUF that base came from, the
    run's sampling settings (for a Modelfile)."""

    checkpoint: Path
    base_model: str
    step: Optional[int]
    gguf: Optional[Path]  # the GGUF the base was imported from: its metadata (tokenizer, template) is copied
    model_path: str  # model.path as the run was configured ("zoo:...", a .gguf, "tiny", a directory)
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def has_adapters(self) -> bool:
        return (self.checkpoint / "adapters.safetensors").is_file()


def find_checkpoint(path: str | Path, step: Optional[int] = None) -> Path:
    """A checkpoint directory: `path` itself, or a run directory's latest (or step `step`'s newest write)."""
    path = Path(path)
    if (path / CHECKPOINT_META).is_file():
        if step is not None:
            raise ExportError(f"{path} is a checkpoint; --step picks one in a run directory")
        return path
    if not (path / "checkpoints").is_dir():
        raise ExportError(f"{path} is neither a run directory (no checkpoints/) nor a checkpoint (no {CHECKPOINT_META})")
    if step is None:
        latest = latest_checkpoint(path)
        if latest is None:
            raise ExportError(f"{path} has no complete checkpoint yet")
        return latest
    found = [p for p in checkpoints(path / "checkpoints") if (checkpoint_key(p.name) or (-1, 0))[0] == step]
    if not found:
        steps = sorted({key[0] for p in checkpoints(path / "checkpoints") if (key := checkpoint_key(p.name))})
        raise ExportError(f"{path} has no checkpoint of step {step} (it has: {', '.join(map(str, steps)) or 'none'})")
    return found[-1]


def read_source(path: str | Path, step: Optional[int] = None) -> ExportSource:
    """Everything an export reads from a run directory or checkpoint, checked before anything is loaded."""
    checkpoint = find_checkpoint(path, step)
    meta = _json(checkpoint / CHECKPOINT_META)
    base = meta.get("base_model")
    if not isinstance(base, str) or not base:
        raise ExportError(f"{checkpoint / CHECKPOINT_META} names no base_model")
    run = _run_config(checkpoint.parent.parent)
    generation = run.get("generation", {})
    model_path = str(run.get("model", {}).get("path", base))
    return ExportSource(
        checkpoint=checkpoint, base_model=base, step=meta.get("step"), gguf=origin_gguf(base, model_path),
        model_path=model_path, temperature=float(generation.get("temperature", 1.0)),
        top_p=float(generation.get("top_p", 1.0)),
    )


def _run_config(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/config.json, or {} for a checkpoint outside a run directory (then the checkpoint's own base is used)."""
    path = run_dir / RUN_CONFIG
    return _json(path) if path.is_file() else {}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not a JSON object")
    return data


def origin_gguf(base_model: str, model_path: str) -> Optional[Path]:
    """The GGUF the base directory was imported from, when the run's model.path names it and its digest is the one
    the import recorded (so the metadata copied is that of the weights trained); None for a model from elsewhere."""
    from grpo_fleet.models.gguf.importer import file_digest
    from grpo_fleet.models.zoo import gguf_file, is_gguf_source

    marker = Path(base_model) / IMPORT_MARKER
    if not marker.is_file() or not is_gguf_source(model_path):
        return None
    recorded = _json(marker).get("blake3")
    try:
        source = gguf_file(model_path)
    except Exception as exc:  # a zoo model that cannot be fetched, an app's model that was removed
        raise ExportError(f"the run's model {model_path!r} (whose tokenizer and template the GGUF copies) "
                          f"cannot be found: {exc}") from None
    if not source.is_file() or file_digest(source) != recorded:
        raise ExportError(f"{source} is not the file {base_model} was imported from (its digest changed); "
                          "restore that file to export a GGUF")
    return source
