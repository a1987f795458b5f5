"""The GGUF header of a model that did not come from a GGUF: built from its mlx-lm (Hugging Face) directory, as
llama.cpp's convert_hf_to_gguf.py builds one, for the families import-gguf reads.

- The hyperparameters are mlx-lm's own reading of config.json (the model class's ModelArgs, its defaults included:
  what the fused model ran with), put into import-gguf's Hyper and written as the `<arch>.*` keys import-gguf reads
  back (so reading this header gives that Hyper again). Llama 3's rope scaling becomes llama.cpp's rope_freqs tensor.
- What llama.cpp's graph fixes rather than reads (Gemma 3's window pattern, local rope base, query scale) must be
  what mlx-lm runs, or the export is refused: llama.cpp would run another model.
- The tokenizer and chat template come from tokenizer.json and tokenizer_config.json (hf_vocab.py).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from grpo_fleet.export.gguf_writer import Header
from grpo_fleet.export.hf_vocab import add_vocab, read_hf_vocab
from grpo_fleet.export.source import ExportError
from grpo_fleet.models.gguf.metadata import FAMILIES, Family, Hyper, llama3_factors, model_config

_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}
# Settings of mlx-lm's model classes that llama.cpp's graph for the family has no way to say: each must be the
# default (every layer attending to all tokens, rope on halves).
_UNSAID = {"rope_traditional": False, "sliding_window": None}
_GEMMA_FIXED = ("sliding_window_pattern", "rope_local_base_freq", "query_pre_attn_scalar")


def model_directory(path: str) -> Path:
    """The local directory of a model path (a hub id resolves to its downloaded snapshot, as mlx_lm.load's does)."""
    from mlx_lm.utils import _download

    return Path(_download(path))


def header_from_hf(model_dir: Path) -> Header:
    """The header for the model in `model_dir`, or an ExportError that says in one line what llama.cpp would lack."""
    config = _config(model_dir)
    family = _family(config)
    args = _model_args(config, family)
    hyper = _hyper(args, family)
    _check_unsaid(args, family, hyper)
    vocab = read_hf_vocab(model_dir, hyper.vocab_size)
    extra: tuple[tuple[str, np.ndarray], ...] = ()
    if hyper.rope_scaling and hyper.rope_scaling.get("rope_type") == "llama3":
        factors = llama3_factors(hyper.rope_scaling, hyper.rope_theta, hyper.head_dim).astype(np.float32)
        extra = (("rope_freqs.weight", factors),)

    def add_metadata(writer: GGUFWriter) -> None:
        add_hyperparameters(writer, hyper, has_head_dim=getattr(args, "head_dim", None) is not None)
        add_vocab(writer, vocab, model_dir)

    return Header(family, hyper.heads, hyper.kv_heads, hyper.layers, add_metadata, extra)


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    if "quantization" in config or "quantization_config" in config:
        raise ExportError(f"{model_dir} holds quantized weights (config.json's quantization): a GGUF is written from "
                          "unquantized ones; train from the unquantized model to export one")
    return dict(config)


def _family(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise ExportError(f"model_type {model_type!r} has no GGUF export (supported: {', '.join(_BY_MODEL_TYPE)}); "
                          "llama.cpp's convert_hf_to_gguf.py may convert the mlx-lm directory")
    return _BY_MODEL_TYPE[model_type]


def _model_args(config: dict[str, Any], family: Family) -> Any:
    """mlx-lm's ModelArgs for the config: the hyperparameters the fused model runs with, defaults included."""
    module = importlib.import_module(f"mlx_lm.models.{family.model_type}")
    try:
        return module.ModelArgs.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"config.json is not a {family.model_type} model's: {exc}") from None


def _hyper(args: Any, family: Family) -> Hyper:
    heads = int(args.num_attention_heads)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    context = getattr(args, "max_position_embeddings", None) or 4096  # import-gguf's default when a file says none
    return Hyper(
        architecture=family.architecture, hidden_size=int(args.hidden_size), layers=int(args.num_hidden_layers),
        intermediate_size=int(args.intermediate_size), heads=heads,
        kv_heads=int(getattr(args, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
        vocab_size=int(args.vocab_size), rms_norm_eps=float(args.rms_norm_eps), rope_theta=float(args.rope_theta),
        context_length=int(context),
        sliding_window=int(args.sliding_window) if family.architecture == "gemma3" else None,
        rope_scaling=_rope_scaling(getattr(args, "rope_scaling", None), family),
    )


def _rope_scaling(scaling: Optional[dict[str, Any]], family: Family) -> Optional[dict[str, Any]]:
    """None, linear (a factor llama.cpp reads), or Llama 3's (rope_freqs); any other kind is refused."""
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(scaling["factor"])}  # type: ignore[index]
    if kind == "llama3" and family.architecture == "llama":
        return dict(scaling)  # type: ignore[arg-type]
    raise ExportError(f"rope scaling {kind!r} ({family.architecture}) has no GGUF export (supported: linear; Llama 3's)")


def _check_unsaid(args: Any, family: Family, hyper: Hyper) -> None:
    """Refuse settings llama.cpp's graph for the family cannot be told (it would run another model)."""
    said = {key: getattr(args, key, value) for key, value in _UNSAID.items() if family.architecture != "gemma3"}
    said["layer_types"] = sorted(set(getattr(args, "layer_types", None) or ["full_attention"]))
    for key, value in said.items():
        if value != _UNSAID.get(key, ["full_attention"]):
            raise ExportError(f"config.json's {key} = {value!r}: llama.cpp's {family.architecture} has no such "
                              "setting, so no GGUF would run this model")
    if family.architecture == "gemma3":
        fixed = model_config(hyper, [0], None, tied=True)  # what import-gguf (llama.cpp's reading) makes of a GGUF
        for key in _GEMMA_FIXED:
            if getattr(args, key) != fixed[key]:
                raise ExportError(f"config.json's {key} is {getattr(args, key)}, where llama.cpp's gemma3 fixes "
                                  f"{fixed[key]}: no GGUF would run this model")


def add_hyperparameters(writer: GGUFWriter, hyper: Hyper, has_head_dim: bool) -> None:
    """The `<arch>.*` keys read_hyper reads (and llama.cpp), as convert_hf_to_gguf writes them."""
    writer.add_context_length(hyper.context_length)
    writer.add_embedding_length(hyper.hidden_size)
    writer.add_block_count(hyper.layers)
    writer.add_feed_forward_length(hyper.intermediate_size)
    writer.add_head_count(hyper.heads)
    writer.add_head_count_kv(hyper.kv_heads)
    writer.add_layer_norm_rms_eps(hyper.rms_norm_eps)
    writer.add_rope_freq_base(hyper.rope_theta)
    writer.add_vocab_size(hyper.vocab_size)
    if has_head_dim:
        writer.add_key_length(hyper.head_dim)
        writer.add_value_length(hyper.head_dim)
    if hyper.sliding_window is not None:
        writer.add_sliding_window(hyper.sliding_window)
    if hyper.rope_scaling and hyper.rope_scaling.get("type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(hyper.rope_scaling["factor"])
