"""Models: load through mlx_lm, LoRA or full fine-tuning, weight blobs, checkpoints
(the self-built tiny model used by the tests and the demo is in models/tiny_model.py).

Everything goes through `mlx_lm.load`, so a real mlx-community model (quantized or
not) takes exactly the same path as the tiny one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, cast

import blake3
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_reduce

from grpo_fleet.config import LoraConfig
from grpo_fleet.models.quant import is_quantized, prepare_weights
from grpo_fleet.runtime.checkpoint_dirs import latest_checkpoint as latest_checkpoint  # where callers have found it
from grpo_fleet.runtime.digest import blob_digest
from grpo_fleet.runtime.doctor import wants_dequantize
from grpo_fleet.runtime.durable import sync_path, sync_tree


@dataclass
class Policy:
    """A loaded policy: the model, its tokenizer wrapper, and how it is trained."""

    model: nn.Module
    tokenizer: Any
    path: str
    lora: Optional[LoraConfig]
    vocab_size: int


def parameter_count(model: nn.Module) -> int:
    """Elements in every parameter (a quantized layer counts its packed weights, scales and biases)."""
    return int(tree_reduce(lambda total, leaf: total + leaf.size, model.parameters(), 0))


def default_dtype() -> Optional[str]:
    """fp32 on the CPU backend (bf16 matmul is slow there); keep the model's dtype on a GPU."""
    return None if mx.default_device() == mx.gpu else "float32"


def load_policy(
    path: str, *, lora: Optional[LoraConfig] = None, dtype: Optional[str] = None, dequantize: Optional[bool] = None
) -> Policy:
    """Load a model directory or hub id through mlx_lm and make it trainable.

    With LoRA the base stays frozen and adapters are added; otherwise every weight
    is trainable (which a quantized model cannot be). A quantized model is
    dequantised for compute when `dequantize` is on (default: on the CPU backend,
    see `grpo_fleet.models.quant`); the weights on disk, and so the digest, are unchanged.
    """
    model, tokenizer = _mlx_lm_load(path)
    lora = lora if lora is not None and lora.enabled else None
    if lora is None:
        # Refused on every backend, so a CPU learner never broadcasts full weights a 4-bit Metal actor can't take.
        _refuse_quantized_full_finetune(model, path)
    prepare_weights(model, path, dtype or default_dtype(), wants_dequantize(dequantize))
    if lora is not None:
        apply_lora(model, lora)
    else:
        model.unfreeze()
    model.train(False)
    vocab_size = int(model.args.vocab_size) if hasattr(model, "args") else len(tokenizer.get_vocab())
    return Policy(model=model, tokenizer=tokenizer, path=path, lora=lora, vocab_size=vocab_size)


def _refuse_quantized_full_finetune(model: nn.Module, path: str) -> None:
    if is_quantized(model):
        raise ValueError(f"{path} is quantized: full fine-tuning is impossible, enable [lora]")


def lora_parameters(lora: LoraConfig) -> dict[str, Any]:
    """The `lora_parameters` block mlx-lm expects (it requires `scale`)."""
    params: dict[str, Any] = {"rank": lora.rank, "scale": lora.scale, "dropout": lora.dropout}
    if lora.keys:
        params["keys"] = list(lora.keys)
    return params


def apply_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Freeze the base and add adapters to the last `num_layers` blocks (all if -1)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    num_layers = len(model.layers) if lora.num_layers < 0 else lora.num_layers
    linear_to_lora_layers(model, num_layers, lora_parameters(lora))


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "lora_b")]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model (pi_ref) by swapping every adapter's `lora_b` for zeros, then restore it.

    This is why pi_ref needs no second copy of the weights under LoRA. Arrays are
    swapped rather than the `scale` attribute because a compiled train step
    treats attributes as constants (changing one would force a retrace).
    """
    layers = _lora_layers(model)
    saved = [layer.lora_b for layer in layers]
    try:
        for layer, value in zip(layers, saved):
            layer.lora_b = mx.zeros_like(value)
        yield
    finally:
        for layer, value in zip(layers, saved):
            layer.lora_b = value


def trainable_weights(model: nn.Module) -> dict[str, mx.array]:
    """The flat dict of weights that training changes (adapters, or everything)."""
    return dict(tree_flatten(model.trainable_parameters()))


def weights_to_bytes(weights: dict[str, mx.array]) -> bytes:
    """Serialise weights as safetensors bytes (dtype and shape preserved, no pickle)."""
    buffer = io.BytesIO()
    mx.save_safetensors(buffer, weights)
    return buffer.getvalue()


def weights_from_bytes(blob: bytes | bytearray) -> dict[str, mx.array]:
    """Parse safetensors bytes back into arrays."""
    return _safetensors(io.BytesIO(blob))


def _safetensors(source: str | io.BytesIO) -> dict[str, mx.array]:
    """The arrays of a safetensors file (mx.load's declared result also covers other formats)."""
    return cast(dict[str, mx.array], mx.load(source, format="safetensors"))


def digest_bytes(blob: bytes | bytearray) -> str:
    """BLAKE3-256 hex digest used to check every weight blob before it is swapped in."""
    return blob_digest(blob)


def load_weight_blob(model: nn.Module, blob: bytes | bytearray, expected_digest: str) -> None:
    """Swap in a weight blob after checking its digest and that every name and shape exists."""
    if digest_bytes(blob) != expected_digest:
        raise ValueError("weight blob digest mismatch; keeping the current snapshot")
    incoming = weights_from_bytes(blob)
    current = dict(tree_flatten(model.parameters()))
    for name, value in incoming.items():
        if name not in current or current[name].shape != value.shape:
            raise ValueError(f"weight blob does not fit the model at {name!r}")
    model.load_weights(list(incoming.items()), strict=False)
    mx.eval(model.parameters())


def model_digest(path: str) -> str:
    """A digest of a model directory's config and weights, so actors can prove they load the same base."""
    from mlx_lm.utils import _download

    root = Path(_download(path))
    digest = blake3.blake3()
    for name in sorted(p.name for p in root.iterdir() if p.suffix in (".json", ".safetensors")):
        digest.update(name.encode())
        with open(root / name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def _commit_dir(staging: Path, final: Path) -> None:
    """Put the fsynced `staging` at `final`, the rename itself made durable (the parent directory fsynced).

    Over an existing `final` (an export written twice; a run's checkpoints never are: runtime/checkpoint_dirs.py) the old
    one is moved aside first: a kill between the two renames leaves it as `.NAME.old`.
    """
    if final.exists():
        trash = final.with_name(f".{final.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(staging, final)
        sync_path(final.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(staging, final)
        sync_path(final.parent)


def save_checkpoint(
    policy: Policy,
    out_dir: str | Path,
    extra: Optional[dict] = None,
    write_extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write the trainable weights in mlx-lm's format, atomically.

    LoRA: `adapters.safetensors` + `adapter_config.json` (load with
    `mlx_lm.load(base, adapter_path=out_dir)`). Full fine-tuning: an HF-format model
    directory (load with `mlx_lm.load(out_dir)`). `write_extra(staging_dir)` adds
    files (optimizer, learner state) inside the same atomic swap.
    """
    final = Path(out_dir)
    staging = atomic_dir(final)
    if policy.lora is not None:
        mx.save_safetensors(str(staging / "adapters.safetensors"), trainable_weights(policy.model))
        _write_adapter_config(staging / "adapter_config.json", policy)
    else:
        _save_full_model(policy, staging)
    with open(staging / "grpo_fleet.json", "w") as handle:
        json.dump({"base_model": policy.path, **(extra or {})}, handle, indent=2)
    if write_extra is not None:
        write_extra(staging)
    sync_tree(staging)  # every file's data, then the names in it, before the rename can make it visible
    _commit_dir(staging, final)
    return final


def _write_adapter_config(path: Path, policy: Policy) -> None:
    assert policy.lora is not None
    num_layers = len(policy.model.layers) if policy.lora.num_layers < 0 else policy.lora.num_layers
    config = {
        "fine_tune_type": "lora",
        "model": policy.path,
        "num_layers": num_layers,
        "lora_parameters": lora_parameters(policy.lora),
    }
    with open(path, "w") as handle:
        json.dump(config, handle, indent=2)


def _save_full_model(policy: Policy, staging: Path) -> None:
    from mlx_lm.utils import _download, save_model

    source = Path(_download(policy.path))
    save_model(staging, policy.model)
    for item in source.iterdir():
        # Config and tokenizer files come from the source; weights were just written.
        if item.is_file() and not item.name.startswith("model") and item.suffix != ".safetensors":
            shutil.copy(item, staging / item.name)


def _mlx_lm_load(path: str, adapter_path: Optional[str] = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from `mlx_lm.load`, whose declared result is a 2- or 3-tuple by flag."""
    import mlx_lm

    loaded = mlx_lm.load(path, adapter_path=adapter_path)
    return loaded[0], loaded[1]


def load_checkpoint(checkpoint: str | Path) -> tuple[nn.Module, Any]:
    """Load a checkpoint written by `save_checkpoint` through mlx_lm, as a user would."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "adapters.safetensors").exists():
        base = json.loads((checkpoint / "grpo_fleet.json").read_text())["base_model"]
        return _mlx_lm_load(base, adapter_path=str(checkpoint))
    return _mlx_lm_load(str(checkpoint))


def load_checkpoint_weights(policy: Policy, checkpoint: str | Path) -> None:
    """Load a checkpoint's trainable weights into an already-built policy (for resume)."""
    checkpoint = Path(checkpoint)
    adapters = checkpoint / "adapters.safetensors"
    files = [adapters] if adapters.exists() else sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights in checkpoint {checkpoint}")
    for file in files:
        policy.model.load_weights(list(_safetensors(str(file)).items()), strict=False)
    mx.eval(policy.model.parameters())
