"""Run directories as a learner leaves them, for the export tests: a GGUF imported, LoRA adapters on it (zero, as
before any step, or drawn at random, as after some), a checkpoint of step N, and RUN_DIR/config.json."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from grpo_fleet.config import LoraConfig
from grpo_fleet.models.gguf.importer import import_gguf
from grpo_fleet.models.loading import Policy, load_policy, save_checkpoint
from grpo_fleet.runtime.checkpoint_dirs import OPTIMIZER_FILE, STATE_FILE, point_latest


def _placeholders(staging: Path) -> None:
    """The learner's state and optimizer files, which make a checkpoint complete; export never reads them."""
    for name in (STATE_FILE, OPTIMIZER_FILE):
        (staging / name).write_bytes(b"not read by export")


def lora_policy(base: Path, *, trained: float, rank: int = 4) -> Policy:
    """The imported base with adapters; `trained` > 0 draws lora_b so the adapters change the model."""
    policy = load_policy(str(base), lora=LoraConfig(enabled=True, rank=rank))
    if trained:
        mx.random.seed(3)
        drawn = [(name, trained * mx.random.normal(value.shape))
                 for name, value in tree_flatten(policy.model.trainable_parameters()) if name.endswith("lora_b")]
        policy.model.load_weights(drawn, strict=False)
    mx.eval(policy.model.parameters())
    return policy


def full_policy(base: Path, trained: float) -> Policy:
    """The imported base with every weight trainable, its norms moved by `trained` (a full fine-tune's checkpoint)."""
    policy = load_policy(str(base))
    moved = [(name, value + trained) for name, value in tree_flatten(policy.model.parameters()) if "norm" in name]
    policy.model.load_weights(moved, strict=False)
    mx.eval(policy.model.parameters())
    return policy


def run_from_gguf(root: Path, gguf: Path | str, *, model_path: str | None = None, trained: float = 0.0, step: int = 0,
                  generation: dict[str, Any] | None = None, full: bool = False) -> tuple[Path, Policy]:
    """A run directory whose latest checkpoint is step `step`'s adapters on `gguf` imported into root/base (`full`:
    every weight trained instead, `trained` added to the norms)."""
    base = import_gguf(gguf, root / "base")
    return run_from_dir(root, base, model_path=model_path or str(gguf), trained=trained, step=step,
                        generation=generation, full=full)


def run_from_dir(root: Path, base: Path, *, model_path: str | None = None, trained: float = 0.0, step: int = 0,
                 generation: dict[str, Any] | None = None, full: bool = False) -> tuple[Path, Policy]:
    """A run directory trained from the mlx-lm directory `base` (model.path: `model_path`, else `base` itself)."""
    policy = full_policy(base, trained) if full else lora_policy(base, trained=trained)
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    config = {"model": {"path": model_path or str(base)},
              "generation": generation or {"temperature": 0.7, "top_p": 1.0}}
    (run / "config.json").write_text(json.dumps(config))
    checkpoint = run / "checkpoints" / f"step_{step:06d}"
    save_checkpoint(policy, checkpoint, extra={"step": step}, write_extra=_placeholders)
    point_latest(run / "checkpoints", checkpoint, {"step": step})
    return run, policy


def raw_metadata(path: Path) -> dict[str, bytes]:
    """Each metadata entry's bytes as the file holds them (type and value), by key: what byte-equal means."""
    data = path.read_bytes()
    _, _, count = struct.unpack_from("<IQQ", data, 4)
    pos, entries = 24, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + length].decode()
        start = pos + 8 + length
        pos = _skip_value(data, start)
        entries[key] = data[start:pos]
    return entries


_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_value(data: bytes, pos: int) -> int:
    (kind,) = struct.unpack_from("<I", data, pos)
    pos += 4
    if kind == 8:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    if kind != 9:
        return pos + _WIDTH[kind]
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    for _ in range(count):
        pos = pos + 8 + struct.unpack_from("<Q", data, pos)[0] if item == 8 else pos + _WIDTH[item]
    return pos
