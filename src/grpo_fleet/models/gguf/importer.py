"""GGUF file -> mlx-lm model directory.

A GGUF (llama.cpp's format) holds the weights, the hyperparameters and the
tokenizer in one file. `import_gguf` turns one into a directory that
`mlx_lm.load` reads, the path every model in this project takes:

- the header is read strictly (header.py): a truncated, damaged or hostile
  file is one GGUFError naming the file, and nothing is written;
- the family (llama incl. Llama 3.x's rope scaling, qwen2, qwen3, gemma3) and its
  hyperparameters come from the checked metadata (metadata.py), and the
  tensors must be exactly the parameters of mlx-lm's own model class for it;
- tensors of every common type are dequantized by the `gguf` package's
  dequantizers and streamed into model.safetensors (weights.py);
- the tokenizer is built with `tokenizers` from the vocabulary in the metadata;
  `tokenizer_config.json` carries the chat template and the special tokens
  (tokenizer.py, spm.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import blake3

from grpo_fleet.models.gguf.header import GGUFFile, read_gguf
from grpo_fleet.models.gguf.metadata import (
    GGUFError,
    Hyper,
    check_architecture,
    check_rope_factors_shape,
    llama3_rope_scaling,
    model_config,
    read_hyper,
)
from grpo_fleet.models.gguf.tokenizer import (
    Specials,
    Vocab,
    build_tokenizer,
    read_specials,
    read_vocab,
    tokenizer_config,
    with_bos,
)
from grpo_fleet.models.gguf.weights import (
    SUPPORTED_TENSOR_TYPES,
    Planned,
    check_against_model,
    check_tensor_types,
    dequantized,
    plan_weights,
    unpermute_rope_rows,
    write_safetensors,
)

__all__ = ["DTYPES", "GGUFError", "IMPORT_FORMAT", "SUPPORTED_TENSOR_TYPES", "cached_import", "dequantized", "file_digest",
           "import_gguf", "is_gguf_path", "read_layout", "unpermute_rope_rows"]

DTYPES = ("float32", "bfloat16", "float16")
# 3: every type through gguf.quants, streamed safetensors, the families' configs. Bump when the output of an
# import changes, so cached imports are redone.
IMPORT_FORMAT = 3
MARKER = "gguf_source.json"  # what makes a directory one this importer wrote (and so may replace)


def file_digest(path: str | Path) -> str:
    """BLAKE3 of the file's bytes: the key of an import in a cache."""
    digest = blake3.blake3()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_gguf_path(path: str) -> bool:
    return path.lower().endswith(".gguf")


def read_layout(path: str | Path) -> tuple[str, dict[str, str]]:
    """The architecture and each tensor's ggml type name."""
    gguf = read_gguf(path)
    architecture = gguf.metadata.get("general.architecture", "unknown")
    return str(architecture), {info.name: info.type_name for info in gguf.tensors}


@dataclass
class Prepared:
    """Everything an import writes, read and checked first: a file that fails any check writes nothing."""

    gguf: GGUFFile
    hyper: Hyper
    plan: list[Planned]
    config: dict[str, Any]
    vocab: Vocab
    specials: Specials
    tokenizer: Any


def prepare(source: Path) -> Prepared:
    """Read and check `source`: the header, the family, the tensor types and shapes, the tokenizer."""
    gguf = read_gguf(source)
    metadata = gguf.metadata
    check_architecture(metadata.get("general.architecture", "unknown"))
    check_tensor_types(gguf.tensors, str(metadata["general.architecture"]))
    embedding = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
    if embedding is None or len(embedding.shape) != 2:
        raise GGUFError("the file has no two-dimensional token_embd.weight")
    hyper = read_hyper(metadata, embedding.shape[0])
    rope = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if rope is not None and hyper.architecture == "llama":
        check_rope_factors_shape(rope.shape, hyper)
        hyper = replace(hyper, rope_scaling=llama3_rope_scaling(dequantized(gguf, rope), hyper, metadata))
    plan = plan_weights(gguf.tensors, hyper)
    vocab = read_vocab(metadata, hyper)
    specials = read_specials(metadata, vocab, hyper)
    tied = not any(p.target == "lm_head.weight" for p in plan)
    config = model_config(hyper, specials.eos, specials.bos, tied)
    check_against_model(plan, config)
    try:
        tokenizer = with_bos(build_tokenizer(vocab), vocab, specials)
    except GGUFError:  # our own refusal (a vocabulary bomb): already one line
        raise
    except Exception as exc:  # the tokenizers library's own refusal of this vocabulary (a merge of unknown pieces)
        raise GGUFError(f"the tokenizer in the metadata cannot be built: {exc}") from None
    return Prepared(gguf, hyper, plan, config, vocab, specials, tokenizer)


def import_gguf(source: str | Path, out_dir: str | Path, *, dtype: str = "float32", force: bool = False) -> Path:
    """Write an mlx-lm directory for the GGUF at `source` into `out_dir`, atomically: all of it or nothing.

    An existing `out_dir` is replaced only if an import wrote it (it holds gguf_source.json), or with
    `force`; never the working directory, a directory above it, or the one holding `source`.
    """
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source, out_dir = Path(source), Path(out_dir)
    if not source.is_file():
        raise GGUFError(f"no GGUF file at {source}")
    check_out_dir(out_dir, source, force)
    try:
        prepared = prepare(source)
    except GGUFError as exc:  # one line that names the file, whichever check refused it
        raise exc if str(source) in str(exc) else GGUFError(f"{source}: {exc}") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
    try:
        _write(prepared, staging, source, dtype)
        _replace(staging, out_dir)
    except GGUFError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise GGUFError(f"{source}: {exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def check_out_dir(out_dir: Path, source: Path, force: bool) -> None:
    """Refuse to replace a directory the importer did not write (unless forced) or one it must never replace."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    resolved, cwd = out_dir.resolve(), Path.cwd().resolve()
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise GGUFError(f"{out_dir} exists and is not a directory; choose another OUT_DIR")
    if resolved == cwd or resolved in cwd.parents or resolved in source.resolve().parents:
        raise GGUFError(f"{out_dir} is the working directory, above it, or holds the GGUF; choose another OUT_DIR")
    if not force and not (out_dir / MARKER).is_file():
        raise GGUFError(f"{out_dir} exists and was not written by import-gguf; choose another OUT_DIR, or pass --force "
                        "to replace it")


def _write(prepared: Prepared, staging: Path, source: Path, dtype: str) -> None:
    write_safetensors(staging / "model.safetensors", prepared.gguf, prepared.plan, prepared.hyper, dtype)
    config = prepared.config | {"torch_dtype": dtype}
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    prepared.tokenizer.save(str(staging / "tokenizer.json"))
    settings = tokenizer_config(prepared.gguf.metadata, prepared.vocab, prepared.specials, prepared.hyper)
    (staging / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (staging / MARKER).write_text(json.dumps(
        {"file": source.name, "blake3": file_digest(source), "dtype": dtype, "format": IMPORT_FORMAT}, indent=2) + "\n")


def _replace(staging: Path, out_dir: Path) -> None:
    """Put `staging` at `out_dir`; an old import there is moved aside first and removed after, never half-replaced."""
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
    os.rename(out_dir, trash / "old")
    os.rename(staging, out_dir)
    shutil.rmtree(trash, ignore_errors=True)


def cached_import(source: str | Path, cache_root: str | Path, *, dtype: str = "float32") -> Path:
    """The import of `source` under `cache_root`, keyed by the file's digest and the dtype; imported once."""
    digest = file_digest(source)
    target = Path(cache_root) / f"gguf-{digest[:24]}-{dtype}-v{IMPORT_FORMAT}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two actors on one machine share the cache: the second waits for the first import and reuses it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _imported_from(target) == digest:
            return target
        return import_gguf(source, target, dtype=dtype, force=True)


def _imported_from(target: Path) -> str | None:
    """The digest an import directory's marker names (None: no import there, or a damaged marker)."""
    try:
        recorded = json.loads((target / MARKER).read_text()).get("blake3")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) else None
