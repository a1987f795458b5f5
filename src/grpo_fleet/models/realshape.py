"""Real-shape models: a real architecture at its real size, random weights, built locally.

`model.path = "realshape:qwen2.5-0.5b"` (optionally `?layers=4&bits=4&seed=0`) gives
Qwen2.5-0.5B-Instruct's exact mlx-lm `qwen2` architecture and its 151,936-id
vocabulary, with seeded random weights, as the same kind of HF-format directory
that mlx-community ships (bf16 safetensors, or mlx-lm's own 4-bit quantisation).
No hub is needed, so memory, speed and wire sizes can be measured at real shapes
anywhere. Each artefact is built once into a cache directory keyed by everything
that changes its bytes, and appears there atomically.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, cast
from urllib.parse import parse_qsl

import blake3
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from grpo_fleet.models.synthetic_tokenizer import write_tokenizer

log = logging.getLogger("grpo_fleet.models.realshape")

PREFIX = "realshape:"
CACHE_ENV = "GRPO_FLEET_MODEL_CACHE"
# Bumped whenever the builder changes the bytes it writes, so old caches are not reused.
FORMAT_VERSION = 1

# Qwen2.5-0.5B-Instruct's config.json, as published (the fields mlx-lm's qwen2 reads and the rest).
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SHAPES: dict[str, dict[str, Any]] = {"qwen2.5-0.5b": QWEN25_05B}


@dataclass(frozen=True)
class RealShapeSpec:
    """What a `realshape:` path asks for; everything that changes the bytes on disk."""

    shape: str = "qwen2.5-0.5b"
    layers: Optional[int] = None  # None: the shape's own depth
    seed: int = 0
    bits: Optional[int] = None  # None: bf16, as published; 4 or 8: mlx-lm affine quantisation
    group_size: int = 64

    @property
    def num_layers(self) -> int:
        return self.layers if self.layers is not None else int(SHAPES[self.shape]["num_hidden_layers"])

    def key(self) -> str:
        """The cache directory name."""
        weights = "bf16" if self.bits is None else f"q{self.bits}g{self.group_size}"
        return f"{self.shape}-l{self.num_layers}-s{self.seed}-{weights}-v{FORMAT_VERSION}"


# The cache directory name (RealShapeSpec.key) read back, so an actor can rebuild what a learner names.
KEY_PATTERN = re.compile(
    r"^(?P<shape>.+)-l(?P<layers>\d+)-s(?P<seed>\d+)-(?:bf16|q(?P<bits>\d)g(?P<group_size>\d+))-v(?P<version>\d+)$"
)


def is_realshape(path: str) -> bool:
    return path.startswith(PREFIX)


def parse_spec(path: str) -> RealShapeSpec:
    """`realshape:SHAPE[?layers=N&seed=S&bits=B&group_size=G]` -> a spec, or ValueError."""
    if not is_realshape(path):
        raise ValueError(f"{path!r} is not a {PREFIX} path")
    shape, _, query = path[len(PREFIX):].partition("?")
    if shape not in SHAPES:
        raise ValueError(f"unknown real shape {shape!r}; known: {sorted(SHAPES)}")
    fields: dict[str, int] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in ("layers", "seed", "bits", "group_size") or name in fields:
            raise ValueError(f"{path!r}: unknown or repeated option {name!r} (layers, seed, bits, group_size)")
        fields[name] = int(value)
    spec = RealShapeSpec(shape=shape, **fields)
    _check_spec(spec)
    return spec


def _check_spec(spec: RealShapeSpec) -> None:
    if not 1 <= spec.num_layers <= int(SHAPES[spec.shape]["num_hidden_layers"]):
        raise ValueError(f"layers must be 1..{SHAPES[spec.shape]['num_hidden_layers']}, not {spec.layers}")
    if spec.bits not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 (or absent for bf16), not {spec.bits}")
    if spec.group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, not {spec.group_size}")


def spec_from_key(name: str) -> Optional[RealShapeSpec]:
    """The spec whose cache directory is called `name`, or None if no current spec is."""
    match = KEY_PATTERN.match(name)
    if match is None or int(match["version"]) != FORMAT_VERSION or match["shape"] not in SHAPES:
        return None
    bits, group_size = match["bits"], match["group_size"]
    spec = RealShapeSpec(
        shape=match["shape"], layers=int(match["layers"]), seed=int(match["seed"]),
        bits=int(bits) if bits else None, group_size=int(group_size) if group_size else 64,
    )
    try:
        _check_spec(spec)
    except ValueError:
        return None
    return spec if spec.key() == name else None


def local_copy(learner_path: str, cache_dir: Optional[str | Path] = None) -> Optional[Path]:
    """This machine's copy of a real-shape model a learner names by its directory, built if missing.

    The learner sends its own cache path, which means nothing on another Mac; the
    directory name says everything the build needs. None when it is no real-shape
    directory. The caller still checks the digest: same spec, same bytes is
    expected (builds run on the CPU stream everywhere) but not assumed.
    """
    spec = spec_from_key(Path(learner_path).name)
    return None if spec is None else build_realshape(spec, cache_dir)


def default_cache_dir() -> Path:
    """$GRPO_FLEET_MODEL_CACHE, else ~/.cache/grpo-fleet/models."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo-fleet" / "models")


# --------------------------------------------------------------------------- weights


def model_config(spec: RealShapeSpec) -> dict[str, Any]:
    """The shape's published config.json, at the requested depth."""
    config = dict(SHAPES[spec.shape])
    config["num_hidden_layers"] = spec.num_layers
    config["max_window_layers"] = min(int(config.get("max_window_layers", spec.num_layers)), spec.num_layers)
    return config


def _param_key(seed: int, name: str) -> mx.array:
    """One PRNG key per parameter name, so a shallower model's weights are a prefix of a deeper one's."""
    return mx.random.key(int.from_bytes(blake3.blake3(f"{seed}:{name}".encode()).digest()[:7], "little"))


def _init_value(name: str, like: mx.array, seed: int, std: float) -> mx.array:
    """HF's init for Qwen2: normal(0, initializer_range) matrices, zero biases, unit norms."""
    if name.endswith("norm.weight"):
        return mx.ones(like.shape, dtype=mx.bfloat16)
    if name.endswith(".bias"):
        return mx.zeros(like.shape, dtype=mx.bfloat16)
    return mx.random.normal(like.shape, dtype=mx.bfloat16, scale=std, key=_param_key(seed, name))


def init_model(config: dict[str, Any], seed: int) -> nn.Module:
    """mlx-lm's own model class for the config, with seeded bf16 weights.

    MLX is lazy: the default init of the constructor is replaced before it is
    ever evaluated, so the full model is never materialised twice.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    std = float(config.get("initializer_range", 0.02))
    # A list without `destination`: the stub's dict alternative never happens here.
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = [(name, _init_value(name, value, seed, std)) for name, value in flat]
    model.update(tree_unflatten(weights))
    return model


# --------------------------------------------------------------------------- building and caching


def _staging(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    return staging


def _sweep_stale(final: Path, older_than_s: float = 6 * 3600) -> None:
    """Remove staging directories of `final` left by builds killed long ago (a 24-layer one is ~1 GB).

    Only old ones: a younger one may belong to a build still running in another process.
    """
    now = time.time()
    for leftover in final.parent.glob(f".{final.name}.*"):
        with contextlib.suppress(OSError):
            if leftover.is_dir() and now - leftover.stat().st_mtime > older_than_s:
                shutil.rmtree(leftover, ignore_errors=True)


def _publish(staging: Path, final: Path) -> Path:
    """Rename the finished build into place; a concurrent build that won keeps its copy."""
    try:
        os.rename(staging, final)
    except OSError:
        if not (final / "config.json").exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _build_float(spec: RealShapeSpec, final: Path) -> None:
    from mlx_lm.utils import save_config, save_model

    staging = _staging(final)
    try:
        config = model_config(spec)
        write_tokenizer(staging, int(config["vocab_size"]))
        save_model(staging, init_model(config, spec.seed))
        save_config(config, staging / "config.json")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, final)


def _build_quantized(spec: RealShapeSpec, source: Path, final: Path) -> None:
    """mlx-lm's own converter, as mlx-community's 4-bit models are made (convert wants a new dir)."""
    from mlx_lm import convert

    staging = _staging(final)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            convert(str(source), str(staging / "model"), quantize=True, q_group_size=spec.group_size, q_bits=spec.bits)
        log.debug("mlx_lm.convert: %s", printed.getvalue().strip())
        _publish(staging / "model", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_realshape(path_or_spec: str | RealShapeSpec, cache_dir: Optional[str | Path] = None) -> Path:
    """The model directory for a `realshape:` path, built on first use and cached.

    A quantized model is converted from the bf16 one of the same shape, depth and
    seed (built, and kept, first). A build killed half-way leaves only a hidden
    staging directory, never a directory under the final name.
    """
    spec = parse_spec(path_or_spec) if isinstance(path_or_spec, str) else path_or_spec
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final = root / spec.key()
    if (final / "config.json").exists():
        return final
    _sweep_stale(final)
    # On the CPU stream on every machine, so a Mac and a Linux box are meant to write the same bytes.
    with mx.stream(mx.cpu):
        if spec.bits is None:
            log.info("building real-shape model %s (random weights, seed %d) into %s", spec.key(), spec.seed, final)
            _build_float(spec, final)
        else:
            source = build_realshape(replace(spec, bits=None), root)
            log.info("quantizing %s to %d bits (group size %d) into %s", source.name, spec.bits, spec.group_size, final)
            _build_quantized(spec, source, final)
    return final
