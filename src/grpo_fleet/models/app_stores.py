"""Where the chat apps keep their models, and the file that hands an export to Ollama.

- `ollama:NAME[:TAG]`: Ollama's store ($OLLAMA_MODELS, else ~/.ollama/models) holds a JSON manifest per model and
  tag under manifests/registry.ollama.ai/library/NAME/TAG (NAME may be NAMESPACE/NAME, or HOST/NAMESPACE/NAME);
  the layer of media type application/vnd.ollama.image.model names the GGUF by its digest, stored as
  blobs/sha256-HEX. The blob's SHA-256 is checked against that digest.
- `lmstudio:PUBLISHER/NAME`: LM Studio's models folder (~/.lmstudio/models, before that ~/.cache/lm-studio/models)
  holds PUBLISHER/NAME/*.gguf; the one GGUF there (vision projectors aside) is the model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from grpo_fleet.models.gguf.metadata import GGUFError

OLLAMA_PREFIX, LMSTUDIO_PREFIX = "ollama:", "lmstudio:"
OLLAMA_ENV = "OLLAMA_MODELS"
MODEL_LAYER = "application/vnd.ollama.image.model"
# Ollama's own ChatML template (its template/chatml.gotmpl), for a GGUF whose Jinja template is ChatML.
CHATML_TEMPLATE = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                   "<|im_start|>assistant\n")


class AppModelError(GGUFError):
    """An app's model name that does not resolve to one GGUF file, with the reason in one line (a GGUFError, so
    import-gguf, the learner and actors refuse it as they refuse a GGUF file they cannot read)."""


def is_app_path(path: str) -> bool:
    return path.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX))


def app_gguf(path: str) -> Path:
    """The GGUF file an `ollama:` or `lmstudio:` name stands for."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_gguf(path[len(OLLAMA_PREFIX):])
    return lmstudio_gguf(path[len(LMSTUDIO_PREFIX):])


def ollama_models_dir() -> Path:
    return Path(os.environ.get(OLLAMA_ENV) or Path.home() / ".ollama" / "models").expanduser()


def ollama_manifest(name: str) -> Path:
    """Where Ollama keeps NAME[:TAG]'s manifest: the default host and namespace filled in, the tag 'latest'."""
    repo, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "latest")
    parts = repo.split("/")
    if not repo or any(not part or part in (".", "..") for part in parts) or len(parts) > 3 or not tag or "/" in tag:
        raise AppModelError(f"ollama:{name} is not an Ollama model name (NAME[:TAG], NAMESPACE/NAME[:TAG])")
    full = {1: ["registry.ollama.ai", "library"], 2: ["registry.ollama.ai"], 3: []}[len(parts)] + parts
    return ollama_models_dir().joinpath("manifests", *full, tag)


def ollama_gguf(name: str) -> Path:
    """The blob the manifest's model layer names, its SHA-256 checked."""
    manifest = ollama_manifest(name)
    if not manifest.is_file():
        raise AppModelError(f"ollama:{name}: no manifest at {manifest} (is it pulled? `ollama pull {name}`; "
                            f"set {OLLAMA_ENV} if Ollama keeps its models elsewhere)")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise AppModelError(f"ollama:{name}: {manifest} has no layer of type {MODEL_LAYER}") from None
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise AppModelError(f"ollama:{name}: the model layer's digest {digest!r} is not sha256:<64 hex digits>")
    blob = ollama_models_dir() / "blobs" / f"sha256-{hexdigest}"
    if not blob.is_file():
        raise AppModelError(f"ollama:{name}: its model blob {blob} is missing (pull it again)")
    if _sha256(blob) != hexdigest:
        raise AppModelError(f"ollama:{name}: {blob} does not have the digest its manifest names (pull it again)")
    return blob


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders, the current one first."""
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def lmstudio_gguf(name: str) -> Path:
    """The single GGUF in PUBLISHER/NAME of LM Studio's models folder; several are refused, naming them."""
    parts = name.split("/")
    if len(parts) != 2 or any(not part or part in (".", "..") for part in parts):
        raise AppModelError(f"lmstudio:{name} is not PUBLISHER/NAME (as LM Studio's My Models shows it)")
    folder = next((root / name for root in lmstudio_dirs() if (root / name).is_dir()), None)
    if folder is None:
        raise AppModelError(f"lmstudio:{name}: no folder {name} in {' or '.join(map(str, lmstudio_dirs()))}")
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file() and not p.name.lower().startswith("mmproj"))
    if len(found) != 1:
        listed = ", ".join(p.name for p in found) or "none"
        raise AppModelError(f"lmstudio:{name}: {len(found)} GGUF files in {folder} ({listed}); name one by its path")
    return found[0]


def modelfile(gguf_name: str, chat_template: Optional[str], stops: list[str], temperature: float, top_p: float) -> str:
    """An Ollama Modelfile for the GGUF beside it: the run's sampling defaults and stop tokens; the chat template as
    Ollama's own ChatML template when the GGUF's is ChatML, else the template the GGUF carries (Ollama reads it)."""
    lines = [f"FROM ./{gguf_name}", ""]
    if chat_template and "<|im_start|>" in chat_template:
        lines += [f'TEMPLATE """{CHATML_TEMPLATE}"""', ""]
    else:
        lines += ["# No TEMPLATE: Ollama uses the chat template inside the GGUF (tokenizer.chat_template).", ""]
    lines += [f"PARAMETER temperature {temperature:g}", f"PARAMETER top_p {top_p:g}"]
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf: Path, name: str, chat_template: Optional[str], stops: list[str], temperature: float,
                    top_p: float) -> tuple[Path, str]:
    """Write the Modelfile next to `gguf`; returns it and the `ollama create` command that loads it."""
    path = gguf.parent / "Modelfile"
    path.write_text(modelfile(gguf.name, chat_template, stops, temperature, top_p))
    return path, f"ollama create {name} -f {path}"
