"""transformers' walk of its model folders: read from a cache file, not redone in every process.

`import transformers` (5.x) walks the ~560 folders under `transformers/models`, reading ~1,700 files for their
`__all__`, to build its lazy import table (`create_import_structure_from_path`). Measured here with `-X importtime`:
about 0.35 of the 0.86 s that the import takes, in every learner, actor and reward process. Importing the
`transformers.models` package, which `AutoTokenizer` does (mlx-lm's tokenizer loading), walked them all again: the
walk's `lru_cache` is keyed by how the path is spelled, a folder `Path` the first time and the package's
`__init__.py` as a string the second.

`install()` puts a finder in front of Python's import system. It finds nothing itself: when transformers'
`import_utils` module has run, it replaces that module's walk with `cached_walk`'s, before `transformers/__init__`
calls it. The models folder's structure then comes from a JSON file under `cache_dir()`, named by a digest of every
folder and `.py` file the walk reads (path, size, mtime): an upgrade or an edit of any of them names another file.
A stat of those ~2,600 files costs about 30 ms, a tenth of the walk. A file path is looked up as its folder, which
is what the walk itself does with it, so the second walk is a hit as well. A cache file that cannot be read or
does not hold a structure of the walk's shape is walked over and replaced; a cache folder that cannot be written
only costs the walk. Where transformers' internals are not what this expects, nothing is changed.

Upstream's work on this import's time is huggingface/transformers#44246.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

IMPORT_UTILS = "transformers.utils.import_utils"
CACHE_ENV = "GRPO_FLEET_TRANSFORMERS_SCAN_CACHE"
FORMAT = 1  # of the cache file: a change names other files
log = logging.getLogger(__name__)

Walk = Callable[[Any], Any]


def cache_dir() -> Path:
    """$GRPO_FLEET_TRANSFORMERS_SCAN_CACHE, else ~/.cache/grpo-fleet/transformers-scan."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo-fleet" / "transformers-scan")


def tree_digest(folder: str) -> str:
    """A digest of what the walk of `folder` reads: every folder and `.py` file below it, with size and mtime."""
    digest = hashlib.sha256(f"{FORMAT}\0{folder}".encode())

    def visit(path: str) -> None:
        with os.scandir(path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    digest.update(f"d\0{entry.path}\0".encode())
                    visit(entry.path)
                elif entry.name.endswith(".py"):
                    stat = entry.stat()
                    digest.update(f"f\0{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    visit(folder)
    return digest.hexdigest()[:32]


def encode(structure: Any) -> Any:
    """The walk's nested dicts (str and frozenset keys, sets of names) as JSON values."""
    if isinstance(structure, dict):
        return {"dict": [[encode(key), encode(value)] for key, value in structure.items()]}
    if isinstance(structure, (set, frozenset)):
        return {"frozenset" if isinstance(structure, frozenset) else "set": sorted(structure)}
    if isinstance(structure, str):
        return structure
    raise TypeError(f"the walk returned a {type(structure).__name__}, which the cache does not hold")


def decode(value: Any) -> Any:
    """`encode`'s inverse; ValueError for anything `encode` does not write."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        kind, items = next(iter(value.items()))
        if kind == "dict" and isinstance(items, list) and all(isinstance(i, list) and len(i) == 2 for i in items):
            return {_key(decode(key)): decode(item) for key, item in items}
        if kind in ("set", "frozenset") and isinstance(items, list) and all(isinstance(i, str) for i in items):
            return frozenset(items) if kind == "frozenset" else set(items)
    raise ValueError("not a cached walk")


def _key(key: Any) -> Any:
    if not isinstance(key, (str, frozenset)):
        raise ValueError("not a cached walk")
    return key


def read_cached(path: Path) -> Optional[Any]:
    """The structure in `path`, or None if there is none or it is not one the walk could have returned."""
    try:
        structure = decode(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        log.debug("transformers scan cache %s unreadable (%s): walking again", path, exc)
        return None
    return structure if isinstance(structure, dict) else None


def write_cached(path: Path, structure: Any) -> None:
    """Write `structure` to `path` whole or not at all (processes starting together may race: each writes its own
    temporary file, and the last rename wins with a complete file)."""
    temporary: Optional[Path] = None
    try:
        text = json.dumps(encode(structure), separators=(",", ":"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as out:
            temporary = Path(out.name)
            out.write(text)
        os.replace(temporary, path)
    except (OSError, TypeError) as exc:
        log.debug("transformers scan cache %s not written (%s)", path, exc)
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def cached_walk(walk: Walk, folder: Path, directory: Path) -> Walk:
    """`walk` with `folder`'s structure read from (or written to) `directory`, and a file looked up as its folder."""
    memo: dict[str, Any] = {}
    target = os.path.realpath(folder)

    def walk_once(module_path: Any) -> Any:
        if os.path.isfile(module_path):  # the walk reads a file as its folder; so do its caches, now
            module_path = Path(os.path.dirname(module_path))
        if os.path.realpath(module_path) != target:
            return walk(module_path)
        if "structure" not in memo:
            path = directory / f"models-{tree_digest(target)}.json"
            structure = read_cached(path)
            if structure is None:
                structure = walk(module_path)
                write_cached(path, structure)
            memo["structure"] = structure
        return memo["structure"]

    walk_once.__wrapped__ = walk  # type: ignore[attr-defined]  # functools' convention: the walk underneath
    return walk_once


def patch_walk(import_utils: Any, directory: Path) -> bool:
    """Replace `import_utils`' walk with `cached_walk`'s for transformers' models folder; False if it is not there."""
    walk = getattr(import_utils, "create_import_structure_from_path", None)
    module_file = getattr(import_utils, "__file__", None)
    if walk is None or not hasattr(walk, "cache_info") or not module_file:  # not the walk this expects, or patched
        return False
    folder = Path(module_file).parent.parent / "models"
    if not folder.is_dir():
        return False
    import_utils.create_import_structure_from_path = cached_walk(walk, folder, directory)
    return True


class _PatchingLoader(Loader):
    """transformers' own loader for `import_utils`, then `patch_walk` on the module it ran."""

    def __init__(self, inner: Loader) -> None:
        self.inner = inner

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch_walk(module, cache_dir())

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _BeforeImportUtils(MetaPathFinder):
    """Finds `transformers.utils.import_utils` where Python would, once, and wraps its loader."""

    def __init__(self) -> None:
        self.done = False  # not removed from sys.meta_path: the import system is iterating over that list

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None) -> Optional[ModuleSpec]:
        if fullname != IMPORT_UTILS or self.done:
            return None
        self.done = True
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # the import system goes on to its own finders, as if this one were not there
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Once a process, before transformers is imported (the CLI's first step)."""
    if IMPORT_UTILS in sys.modules or any(isinstance(f, _BeforeImportUtils) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeImportUtils())
